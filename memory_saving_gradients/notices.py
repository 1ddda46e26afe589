"""Warning categories of this library, for ``warnings.filterwarnings``.

Every warning the library gives the user is a :class:`MemorySavingGradientsWarning`
(a ``UserWarning``); filter that to silence or escalate them all, or one of
its subclasses for one kind.
"""

from __future__ import annotations


class MemorySavingGradientsWarning(UserWarning):
    """Base class of the warnings this library gives."""


class FallbackWarning(MemorySavingGradientsWarning):
    """A ``gradients()`` call used plain ``tf.gradients`` because the rewrite went wrong
    (its gradients' structure differed from ``tf.gradients``', or it failed inside):
    that call saves no memory, and its gradients are ``tf.gradients``' own."""


__all__ = ["MemorySavingGradientsWarning", "FallbackWarning"]

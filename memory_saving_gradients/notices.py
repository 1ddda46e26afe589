"""Warning categories of the library's user-facing notices.

Layer: foundation; imports nothing.

Notices that tell a user the library saved no memory where it was asked to
go through :func:`warnings.warn` with one of these categories, so that they
can be filtered (``warnings.filterwarnings('ignore', category=...)``) and
tested (``pytest.warns``).  Diagnostics stay on the ``logging`` logger
``"memory_saving_gradients"``.
"""

from __future__ import annotations


class MemorySavingGradientsWarning(UserWarning):
    """Base category of every warning this library issues."""


class NothingKeptWarning(MemorySavingGradientsWarning):
    """A strategy kept no checkpoint for a graph: plain ``tf.gradients`` was used."""


class NothingRewrittenWarning(MemorySavingGradientsWarning):
    """A patch or ``keras.enable`` rewrote no gradient while it was active."""


class EagerExecutionWarning(NothingRewrittenWarning):
    """Gradients ran eagerly (outside ``tf.function``, or Keras ``run_eagerly=True``):
    nothing can be rewritten there."""


class FallbackWarning(MemorySavingGradientsWarning):
    """A ``gradients()`` call used plain ``tf.gradients`` because the rewrite went wrong
    (its gradients' structure differed from ``tf.gradients``', or it failed inside):
    that call saves no memory, and its gradients are ``tf.gradients``' own."""

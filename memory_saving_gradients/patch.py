"""Replacing ``tf.gradients`` & co. with checkpointed gradients, and restoring them.

``patch(checkpoints='memory', **options)`` swaps in memory-saving versions of
every public way TensorFlow 2 code reaches graph gradients:

* ``tf.gradients`` (the TF2 signature: no ``colocate_gradients_with_ops``),
* ``tf.compat.v1.gradients`` (the TF1 signature),
* ``tensorflow.python.ops.gradients.gradients``: the module attribute that
  ``tf.compat.v1.train.Optimizer.compute_gradients`` (and so ``minimize``)
  calls as ``gradients.gradients(...)``,
* the same names in the ``tf.compat.v1``/``tf.compat.v2`` API modules that
  TensorFlow keeps under ``tf.compat.*.compat.*``.

It returns a :class:`Patch` whose ``undo()`` puts back exactly the objects
that were there.  :func:`patched` is the same as a context manager.  Patches
nest: undoing in any order leaves each slot holding what the remaining
patches (or, with none left, the original) put there.

The library itself never calls through these names: it uses TensorFlow's own
``gradients`` captured at import (:data:`._tensorflow.tf_gradients`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from typing import Iterator

from ._tensorflow import tf
from .checkpointing import gradients as _checkpointed_gradients

logger = logging.getLogger("memory_saving_gradients")

#: Where TensorFlow's graph-gradient functions are looked up from:
#: (module, attribute, signature).  A module is ``tf`` or ``tf.<path>`` (an
#: API module reached from ``tf``) or an importable name.  Slots missing from
#: the installed TensorFlow are skipped.
TARGETS = (
    ("tf", "gradients", "v2"),
    ("tf.compat.v1", "gradients", "v1"),
    ("tf.compat.v2", "gradients", "v2"),
    # tf.compat.v1.train.Optimizer.compute_gradients calls gradients.gradients
    ("tensorflow.python.ops.gradients", "gradients", "v1"),
)

_lock = threading.Lock()
_active: list = []  # Patch objects, oldest first


def make_gradients_v1(checkpoints="memory", **options):
    """A function with ``tf.compat.v1.gradients``' signature that checkpoints."""

    def gradients(
        ys,
        xs,
        grad_ys=None,
        name="gradients",
        colocate_gradients_with_ops=False,
        gate_gradients=False,
        aggregation_method=None,
        stop_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        return _checkpointed_gradients(
            ys, xs, grad_ys,
            checkpoints=checkpoints,
            name=name,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            stop_gradients=stop_gradients,
            unconnected_gradients=unconnected_gradients,
            **options,
        )

    gradients.__doc__ = (
        f"tf.compat.v1.gradients with checkpoints={checkpoints!r} "
        "(memory_saving_gradients.patch)."
    )
    return _mark(gradients)


def make_gradients_v2(checkpoints="memory", **options):
    """A function with ``tf.gradients``' (TF2) signature that checkpoints.

    TF1 code that passes ``colocate_gradients_with_ops=`` to ``tf.gradients``
    keeps working: it is accepted as a keyword.
    """

    def gradients(
        ys,
        xs,
        grad_ys=None,
        name="gradients",
        gate_gradients=False,
        aggregation_method=None,
        stop_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
        *,
        colocate_gradients_with_ops=False,
    ):
        return _checkpointed_gradients(
            ys, xs, grad_ys,
            checkpoints=checkpoints,
            name=name,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            stop_gradients=stop_gradients,
            unconnected_gradients=unconnected_gradients,
            **options,
        )

    gradients.__doc__ = (
        f"tf.gradients with checkpoints={checkpoints!r} (memory_saving_gradients.patch)."
    )
    return _mark(gradients)


def _mark(function):
    """Keep autograph out of library code (a tf.function calling tf.gradients
    would convert it) and tag the function as ours."""
    function = tf.autograph.experimental.do_not_convert(function)
    function._memory_saving_gradients = True  # pylint: disable=protected-access
    return function


_MISSING = object()


class Patch:
    """An applied patch; ``undo()`` restores what it replaced (once)."""

    def __init__(self, checkpoints, options: dict):
        self.checkpoints = checkpoints
        self.options = dict(options)
        self.replacements = {
            "v1": make_gradients_v1(checkpoints, **options),
            "v2": make_gradients_v2(checkpoints, **options),
        }
        # (module, attribute) -> (what was there before, what we put there)
        self._slots: dict = {}
        self.active = False

    def _apply(self) -> None:
        for module_name, attribute, signature in TARGETS:
            module = _module(module_name)
            key = (module_name, attribute)
            if module is None or key in self._slots:
                continue
            previous = getattr(module, attribute, _MISSING)
            if previous is _MISSING:
                continue
            new = self.replacements[signature]
            self._slots[key] = (module, previous, new)
            setattr(module, attribute, new)
        self.active = True

    def undo(self) -> None:
        """Put back what this patch replaced.  Calling it again does nothing."""
        with _lock:
            if not self.active:
                return
            index = _active.index(self)
            later = _active[index + 1:]
            for key, (module, previous, new) in self._slots.items():
                # A later patch saw our function as "previous": hand it ours.
                successor = next((p for p in later if key in p._slots), None)
                if successor is not None:
                    s_module, _, s_new = successor._slots[key]
                    successor._slots[key] = (s_module, previous, s_new)
                    continue
                if getattr(module, key[1], _MISSING) is not new:
                    logger.warning(
                        "%s.%s was replaced by someone else after "
                        "memory_saving_gradients.patch(); restoring what was there "
                        "before the patch anyway.",
                        key[0], key[1],
                    )
                setattr(module, key[1], previous)
            del _active[index]
            self.active = False
            logger.debug("memory_saving_gradients: patch(%r) undone", self.checkpoints)

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<memory_saving_gradients.Patch checkpoints={self.checkpoints!r} {state}>"


def patch(checkpoints="memory", **options) -> Patch:
    """Make ``tf.gradients``, ``tf.compat.v1.gradients`` and the v1 optimizers checkpoint.

    Args:
      checkpoints: strategy name or list of tensors, as in :func:`gradients`.
      **options: more keyword arguments for :func:`gradients`
        (e.g. ``memory_budget``).

    Returns:
      A :class:`Patch`; call ``undo()`` (or use it in a ``with`` block) to
      restore exactly the functions that were there.
    """
    if isinstance(checkpoints, tf.Tensor):
        checkpoints = [checkpoints]
    elif not isinstance(checkpoints, str):
        checkpoints = list(checkpoints)
    handle = Patch(checkpoints, options)
    with _lock:
        handle._apply()
        _active.append(handle)
    logger.debug("memory_saving_gradients: patch(%r) applied", checkpoints)
    return handle


@contextlib.contextmanager
def patched(checkpoints="memory", **options) -> Iterator[Patch]:
    """``with patched('memory'): ...``: :func:`patch` for the block, undone after it."""
    handle = patch(checkpoints, **options)
    try:
        yield handle
    finally:
        handle.undo()


def is_patched() -> bool:
    """Whether a :func:`patch` is active."""
    return bool(_active)


def _module(name: str):
    if name == "tf" or name.startswith("tf."):
        module = tf
        for part in name.split(".")[1:]:
            module = getattr(module, part, None)
            if module is None:
                return None
        return module
    try:
        return importlib.import_module(name)
    except ImportError:
        return None

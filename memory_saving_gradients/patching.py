"""Replacing ``tf.gradients`` & co. with checkpointed gradients, and restoring them.

Layer: entry points; imports: checkpointing, reporting, tape, tape_hooks, _tensorflow.

``patch(checkpoints='memory', tape=True, **options)`` swaps in memory-saving
versions of every public way TensorFlow 2 code reaches graph gradients:

* ``tf.GradientTape.gradient`` (with ``tape=True``, the default), for every
  tape while a graph is traced: see :mod:`.tape_hooks`;
* ``tf.gradients`` (the TF2 signature: no ``colocate_gradients_with_ops``),
* ``tf.compat.v1.gradients`` (the TF1 signature),
* the ``gradients`` attribute of TensorFlow's private modules that its own
  code calls, such as the one ``tf.compat.v1.train.Optimizer.compute_gradients``
  (and so ``minimize``) calls as ``gradients.gradients(...)``
  (:data:`._tensorflow.PRIVATE_GRADIENT_SLOTS`),
* every other module of TensorFlow that exposes one of TensorFlow's two
  ``gradients`` functions under that name (``tensorflow.compat.v2.compat.v1``,
  which tf_keras' legacy optimizers call, ``tf.compat.v1.compat.v2``, ...):
  :func:`gradient_slots` lists them.

It returns a :class:`Patch` whose ``undo()`` puts back exactly the objects
that were there.  :func:`patched` is the same as a context manager.  Patches
nest: undoing in any order leaves each slot holding what the remaining
patches (or, with none left, the original) put there.

The library itself never calls through these names: it uses TensorFlow's own
``gradients`` captured at import (:data:`._tensorflow.tf_gradients`).
"""

from __future__ import annotations

import collections.abc
import functools
import importlib
import logging
import sys
import threading
from typing import Any, Callable, ContextManager, Union

from . import _tensorflow as _tf_internals
from . import reporting, tape_hooks
from . import tape as tape_lib
from ._tensorflow import tf
from .checkpointing import Checkpoints, check_arguments, not_checkpoints_error
from .checkpointing import gradients as _checkpointed_gradients

logger = logging.getLogger("memory_saving_gradients")

#: Slots always replaced, whatever they hold: (module, attribute, signature).
#: A module is ``tf`` or ``tf.<path>`` (an API module reached from ``tf``) or
#: an importable name.  Slots missing from the installed TensorFlow are skipped.
TARGETS = (
    ("tf", "gradients", "v2"),
    ("tf.compat.v1", "gradients", "v1"),
    ("tf.compat.v2", "gradients", "v2"),
) + _tf_internals.PRIVATE_GRADIENT_SLOTS

#: API modules loaded before the search, so that lazily loaded ones are found too.
_API_PATHS = ("tf.compat.v1.compat.v1", "tf.compat.v1.compat.v2",
              "tf.compat.v2.compat.v1", "tf.compat.v2.compat.v2")

#: TensorFlow's own functions, by signature.
_TENSORFLOW_FUNCTIONS = {
    id(_tf_internals.tf_gradients): "v1",
    id(_tf_internals.tf_gradients_v2): "v2",
}


def gradient_slots() -> list:
    """``(module name, module, signature)`` of every ``gradients`` name to replace.

    The fixed :data:`TARGETS`, plus every loaded module of TensorFlow whose
    ``gradients`` is one of TensorFlow's two functions (or a function of an
    active patch), except ``gradients_impl`` where they are defined (its own
    functions, such as ``hessians``, keep calling TensorFlow's).  A module
    reached under several names is listed once.
    """
    for path in _API_PATHS:
        _module(path)
    found, seen = [], set()
    for name, _, signature in TARGETS:
        module = _module(name)
        if module is not None and id(module) not in seen and hasattr(module, "gradients"):
            seen.add(id(module))
            found.append((name, module, signature))
    for name, module in sorted(sys.modules.items(), key=lambda item: item[0]):
        if (module is None or id(module) in seen or not name.startswith("tensorflow")
                or _tf_internals.defines_tf_gradients(module)):  # TF's own internals
            continue
        try:
            value = module.__dict__.get("gradients")
        except Exception:  # odd lazy modules raise anything on attribute access
            continue
        signature = _TENSORFLOW_FUNCTIONS.get(id(value)) or getattr(
            value, "_memory_saving_gradients_signature", None
        )
        if signature is not None:
            seen.add(id(module))
            found.append((name, module, signature))
    return found

_lock = threading.Lock()
_active: list = []  # Patch objects, oldest first

#: What ``patch()`` takes as ``checkpoints``: as :func:`gradients`, or one tensor.
PatchCheckpoints = Union[Checkpoints, tf.Tensor]


#: Parameters of gradients() that the replacements pass themselves (not options).
PASSED_BY_THE_REPLACEMENTS = (
    "name", "colocate_gradients_with_ops", "gate_gradients", "aggregation_method",
    "stop_gradients", "unconnected_gradients",
)


def _recorded(record, ys, xs, grad_ys, **arguments):
    """The checkpointed gradients, their rewrite recorded in ``record``; TensorFlow's own
    in autograph's throwaway trace of a loop body, which never runs."""
    if _tf_internals.in_autograph_staging_trace():
        return _tf_internals.tf_gradients(
            ys, xs, grad_ys, **{name: arguments[name] for name in PASSED_BY_THE_REPLACEMENTS})
    with reporting.recording(record):
        return _checkpointed_gradients(ys, xs, grad_ys, **arguments)


def make_gradients_v1(checkpoints: Checkpoints = "memory", record: reporting.Record | None = None,
                      **options: Any) -> Callable[..., list]:
    """A function with ``tf.compat.v1.gradients``' signature that checkpoints
    (its rewrites are recorded in ``record``)."""

    check_arguments(checkpoints, options, PASSED_BY_THE_REPLACEMENTS)

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
        return _recorded(
            record, ys, xs, grad_ys, checkpoints=checkpoints, name=name,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients,
            **options,
        )

    gradients.__doc__ = (
        f"tf.compat.v1.gradients with checkpoints={checkpoints!r} "
        "(memory_saving_gradients.patch())."
    )
    return _mark(gradients, "v1")


def make_gradients_v2(checkpoints: Checkpoints = "memory", record: reporting.Record | None = None,
                      **options: Any) -> Callable[..., list]:
    """A function with ``tf.gradients``' (TF2) signature that checkpoints
    (its rewrites are recorded in ``record``).

    TF1 code that passes ``colocate_gradients_with_ops=`` to ``tf.gradients``
    keeps working: it is accepted as a keyword.
    """

    check_arguments(checkpoints, options, PASSED_BY_THE_REPLACEMENTS)

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
        return _recorded(
            record, ys, xs, grad_ys, checkpoints=checkpoints, name=name,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gate_gradients=gate_gradients, aggregation_method=aggregation_method,
            stop_gradients=stop_gradients, unconnected_gradients=unconnected_gradients,
            **options,
        )

    gradients.__doc__ = (
        f"tf.gradients with checkpoints={checkpoints!r} (memory_saving_gradients.patch())."
    )
    return _mark(gradients, "v2")


def _mark(function, signature: str):
    """Keep autograph out of library code (a tf.function calling tf.gradients
    would convert it) and tag the function as ours."""
    function = tf.autograph.experimental.do_not_convert(function)
    function._memory_saving_gradients = True
    function._memory_saving_gradients_signature = signature
    return function


_MISSING = object()


class Patch:
    """An applied patch; ``undo()`` restores what it replaced (once).

    ``plans`` lists the :class:`~memory_saving_gradients.Plan` of every
    backward pass rewritten while it was active (through a tape or a
    ``gradients`` name), in the order they were built.
    """

    def __init__(self, checkpoints: Checkpoints, options: dict, tape: bool = True):
        self.checkpoints = checkpoints
        self.options = dict(options)
        self.tape = tape
        self._tape_token = None
        self._stop_observing = None
        self.record = reporting.Record()
        self.record.tapes = tape
        self.replacements = {
            "v1": make_gradients_v1(checkpoints, self.record, **options),
            "v2": make_gradients_v2(checkpoints, self.record, **options),
        }
        # (module, attribute) -> (what was there before, what we put there)
        self._slots: dict = {}
        self.active = False
        self._entered = 0  # open ``with`` blocks on this handle

    def _apply(self) -> None:
        attribute = "gradients"
        for module_name, module, signature in gradient_slots():
            key = (module_name, attribute)
            previous = getattr(module, attribute, _MISSING)
            if previous is _MISSING:
                continue
            new = self.replacements[signature]
            self._slots[key] = (module, previous, new)
            setattr(module, attribute, new)
        if self.tape:
            self._tape_token = tape_hooks.push(
                tape_lib.Config.of(self.checkpoints, self.options, self.record)
            )
        # which traced steps the block runs: undo() tells a step checkpointed under an
        # earlier patch from one traced before any
        self._stop_observing = _tf_internals.observe_function_calls(
            functools.partial(reporting.function_ran, self.record))
        self.active = True

    @property
    def plans(self) -> list:
        """The :class:`~memory_saving_gradients.Plan` of every rewrite made under this patch."""
        return self.record.plans

    @property
    def slots(self) -> list:
        """Names of the modules whose ``gradients`` this patch replaced."""
        return [name for name, _ in self._slots]

    def undo(self) -> None:
        """Put back what this patch replaced.  Calling it again does nothing.

        Warns (:class:`~memory_saving_gradients.NothingRewrittenWarning`) if
        the patch rewrote no backward pass, with the likely cause.
        """
        was_active = self.active
        self._restore()
        if was_active:
            reporting.warn_if_nothing_rewritten(
                self.record, f"memory_saving_gradients.patch({self.checkpoints!r})"
            )

    def _restore(self) -> None:
        with _lock:
            if not self.active:
                return
            index = _active.index(self)
            later = _active[index + 1:]
            if self._tape_token is not None:
                tape_hooks.pop(self._tape_token)
                self._tape_token = None
            if self._stop_observing is not None:
                self._stop_observing()
                self._stop_observing = None
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
            logger.debug("patch(%r) undone", self.checkpoints)

    def __enter__(self) -> "Patch":
        if not self.active:
            raise RuntimeError(
                f"{self!r} was undone and cannot be entered again: patch() or patched() "
                "makes a new one.")
        with _lock:
            self._entered += 1
        return self

    def __exit__(self, error_type, *rest: object) -> None:
        """Undoes the patch when the outermost ``with`` block on it ends; where the block
        raised, its error says what happened: no "rewrote nothing" warning beside it."""
        with _lock:
            self._entered -= 1
            if self._entered:
                return
        if error_type is None:
            self.undo()
        else:
            self._restore()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return (f"<memory_saving_gradients.Patch checkpoints={self.checkpoints!r} "
                f"tape={self.tape} {state}>")


def patch(checkpoints: PatchCheckpoints = "memory", tape: bool = True, **options: Any) -> Patch:
    """Make TensorFlow's gradients checkpoint: tapes, ``tf.gradients`` and the v1 optimizers.

    Args:
      checkpoints: strategy name or list of tensors, as in :func:`gradients`.
      tape: also make every ``tf.GradientTape.gradient`` called while a graph
        is traced (``tf.function``, Keras 3 and tf_keras ``fit``, custom
        loops) checkpoint; eager tapes stay plain (warned once).  ``False``:
        only the ``gradients`` names are replaced.
      **options: ``memory_budget`` and ``batch_size``, as for :func:`gradients`
        (each call's own keywords pass through).  A misspelled strategy or
        option, or a bad value, raises here and patches nothing.

    Returns:
      A :class:`Patch`; call ``undo()`` (or use it in a ``with`` block) to
      restore exactly the functions that were there.  Its ``plans`` list the
      :class:`~memory_saving_gradients.Plan` of every backward pass rewritten
      meanwhile; ``undo()`` warns if there was none.
    """
    checkpoints = _as_checkpoints(checkpoints)
    _check(checkpoints, tape, options)
    handle = Patch(checkpoints, options, tape)
    with _lock:
        handle._apply()
        for outer in _active:  # this one rewrites in their place while it is active
            outer.record.nested.append(handle.record)
        _active.append(handle)
    logger.debug("patch(%r) applied", checkpoints)
    return handle


def patched(checkpoints: PatchCheckpoints = "memory", tape: bool = True,
            **options: Any) -> ContextManager[Patch]:
    """``with patched('memory') as handle: ...``: :func:`patch` for the block, undone after it.

    Bad arguments raise here, when it is called; ``handle.plans`` lists what
    was rewritten in the block.
    """
    checkpoints = _as_checkpoints(checkpoints)
    _check(checkpoints, tape, options)
    return _PatchedBlocks(checkpoints, tape, options)


def _as_checkpoints(checkpoints: Any) -> str | list:
    """A strategy name as it is, one tensor or an iterable of them as a list; TypeError
    for anything else (``None``, a number)."""
    if isinstance(checkpoints, tf.Tensor):
        return [checkpoints]
    if isinstance(checkpoints, str):
        return checkpoints
    if (not isinstance(checkpoints, collections.abc.Iterable)
            or isinstance(checkpoints, (bytes, bytearray, collections.abc.Mapping))):
        raise not_checkpoints_error(checkpoints)
    return list(checkpoints)


class _PatchedBlocks:
    """What :func:`patched` returns: each ``with`` block on it applies a new
    :func:`patch` and undoes it when the block ends (so that it can be entered again,
    and nested)."""

    def __init__(self, checkpoints, tape: bool, options: dict):
        self._arguments = (checkpoints, tape, options)
        self._open = threading.local()  # .handles: this thread's blocks, innermost last

    def _handles(self) -> list:
        if not hasattr(self._open, "handles"):
            self._open.handles = []
        return self._open.handles

    def __enter__(self) -> Patch:
        checkpoints, tape, options = self._arguments
        self._handles().append(patch(checkpoints, tape, **options).__enter__())
        return self._handles()[-1]

    def __exit__(self, *error: object) -> None:
        self._handles().pop().__exit__(*error)


def _check(checkpoints, tape: bool, options: dict) -> None:
    """Raise now what the patched functions would raise at the first trace."""
    if not isinstance(tape, bool):
        raise TypeError(f"patch(tape=...) takes True or False; got {tape!r}.")
    if tape and not isinstance(checkpoints, str):
        raise TypeError(
            "patch(tape=True) takes a strategy name (e.g. 'memory'): tapes are traced "
            "later, in graphs that do not exist yet. Pass tape=False to patch only "
            "tf.gradients with these tensors."
        )
    check_arguments(checkpoints, options, PASSED_BY_THE_REPLACEMENTS)


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

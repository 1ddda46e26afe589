"""Leaving nothing behind when building a backward pass fails while a function is traced.

Layer: mutation (tf.function and Keras Python objects after a failed trace); imports:
_tensorflow.

A ``tf.function`` whose first trace raises keeps the state of that trace:
the next call is treated as a later call, and a step that creates
variables then (an optimizer's slots, on its first ``apply_gradients``)
fails with "Creating variables on a non-first call to a function decorated
with tf.function", even with the patch undone.  Keras keeps such a function
as the model's ``train_function`` and reuses it in every later ``fit``.

:func:`after_failure` runs when :func:`~.checkpointing.gradients` raises
(whatever raised: the library, or TensorFlow on the graph it builds), in
the frames of the trace that is failing, and makes each thing being traced
start afresh at its next call: every ``tf.function`` whose first trace is
failing is set back to never traced (unless the failed trace created
variables that are still referenced: those were never initialized, and a
new trace would reuse them), and every Keras model training in these frames
drops its ``train_function`` (Keras builds a new one at the next ``fit``).
"""

from __future__ import annotations

import gc
import logging
import sys
from typing import Iterator

from . import _tensorflow as _tf_internals

logger = logging.getLogger("memory_saving_gradients")

_FIRST_TRACE = _tf_internals.FIRST_TRACE_CODE


def after_failure() -> None:
    """Let the ``tf.function`` s and Keras models being traced here trace again."""
    for frame_code, owner in _frame_owners():
        if frame_code is _FIRST_TRACE:
            _forget_failed_first_trace(owner)
        elif is_keras_model(owner) and getattr(owner, "train_function", None) is not None:
            owner.train_function = None
            logger.debug("dropped %s's train_function after a "
                         "failed trace", getattr(owner, "name", owner))


def keras_model_being_traced() -> object | None:
    """The innermost Keras model whose train step these frames run, or None."""
    for _, owner in _frame_owners():
        if is_keras_model(owner):
            return owner
    return None


def keras_models_with_train_function() -> list:
    """Every live Keras 3 or tf_keras model that holds a built ``train_function``
    (a walk over the objects the garbage collector tracks: for warnings only)."""
    classes = tuple(
        module.Model for module in (sys.modules.get("keras"), sys.modules.get("tf_keras"))
        if module is not None and isinstance(getattr(module, "Model", None), type)
    )
    if not classes:
        return []
    return [value for value in gc.get_objects()
            if isinstance(value, classes) and getattr(value, "train_function", None) is not None]


def keras_models_captured_by(captured_ids: set[int]) -> list | None:
    """The Keras models with a ``train_function`` one of whose variables' handles has
    its id in ``captured_ids`` (the eager values traced functions captured as they
    ran: so their steps ran), or None where TensorFlow's runs are not observed."""
    if not _tf_internals.observes_function_calls():  # pragma: no cover  (another layout)
        return None
    return [model for model in keras_models_with_train_function()
            if _variable_handle_ids(model) & captured_ids]


def _variable_handle_ids(model: object) -> set[int]:
    """Keras 3 wraps each ``tf.Variable`` as ``.value``; tf_keras' are ``tf.Variable`` s
    (whose ``value`` is a method)."""
    ids = set()
    for variable in getattr(model, "variables", ()):
        for holder in (getattr(variable, "value", None), variable):
            try:
                handle = getattr(holder, "handle", None)
            except (ValueError, RuntimeError):  # e.g. a distributed variable's, outside its replica
                handle = None
            if handle is not None:
                ids.add(id(handle))
                break
    return ids


def is_keras_model(value: object) -> bool:
    """Whether ``value`` trains like a Keras model (Keras 3 or tf_keras)."""
    return all(hasattr(type(value), name) for name in ("train_step", "make_train_function", "fit"))


def _frame_owners() -> Iterator[tuple]:
    """``(code, self)`` of every method frame on this thread's stack, innermost first."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_argcount else None
        if owner is not None:
            yield frame.f_code, owner
        frame = frame.f_back


def _forget_failed_first_trace(function) -> None:
    """Set a ``tf.function`` whose first trace is failing back to never traced."""
    if _tf_internals.function_first_trace_done(function):
        return  # its first trace completed: this is a later one
    created = _tf_internals.function_created_variables(function)
    if any(ref() is not None for ref in created):
        logger.debug("the failed trace of %s created variables; "
                     "it is left as TensorFlow left it", getattr(function, "name", function))
        return
    _tf_internals.forget_first_trace(function)

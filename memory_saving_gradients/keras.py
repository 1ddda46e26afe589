"""Keras: ``model.fit`` with memory-saving gradients, for Keras 3 and tf_keras models.

``enable(model, checkpoints='memory', **options)`` wraps the model's own
``train_step`` (Keras' built-in one, or yours if the model's class overrides
it) so that, while it is traced, every ``tf.GradientTape`` in it
checkpoints: the tape-level patch of :mod:`.tape_hooks`, active only for
this model's step.  Keras 3 (TensorFlow backend) and tf_keras (Keras 2,
``tf_keras`` or ``TF_USE_LEGACY_KERAS=1``) models are both accepted: both
compute gradients with ``tape.gradient`` in their ``train_step``
(tf_keras through ``optimizer.minimize(loss, variables, tape=tape)``).

Batch normalization and dropout need nothing special: moving-statistics
updates and random draws are stateful ops, which are never recomputed (their
outputs are kept), and Keras 3 draws dropout masks with a stateless op from a
kept seed, so a recomputed mask equals the original.

``run_eagerly=True`` trains normally (an ``EagerExecutionWarning`` naming the
model and ``run_eagerly`` is issued once: nothing can be rewritten eagerly).
``plans(model)`` lists the :class:`~memory_saving_gradients.Plan` of every
train step rewritten since ``enable``.  With ``jit_compile=True`` the recomputation survives
XLA: while the step is traced for XLA, recomputed inputs depend on the
incoming gradient through data (docs/xla.md).

Keras is imported only when this module's functions are called.
"""

from __future__ import annotations

import logging
import sys
import warnings

from ._tensorflow import tf  # noqa: F401  (TensorFlow before Keras)
from . import notices
from . import reporting
from . import tape as tape_lib
from . import tape_hooks

logger = logging.getLogger("memory_saving_gradients")

_ATTRIBUTE = "_memory_saving_gradients_options"


def enable(model, checkpoints: str = "memory", **options):
    """Make ``model.fit`` (and ``train_on_batch``) train with memory-saving gradients.

    Args:
      model: a Keras 3 ``keras.Model`` on the TensorFlow backend, or a tf_keras
        model.  A ``train_step`` of your own works too, as long as it
        differentiates with ``tf.GradientTape`` (or ``optimizer.minimize`` with
        a tape).
      checkpoints: a strategy name (``'memory'``, ``'speed'``, ...): Keras
        builds the graph later, so tensors cannot be named in advance.
      **options: as for :func:`memory_saving_gradients.gradients`
        (``memory_budget``, ``batch_size``, ...).

    Returns:
      The model (changed in place).  :func:`disable` undoes it.  A
      ``train_function`` the model already built (by an earlier ``fit``) is
      dropped, so that the next ``fit`` traces the step again, with
      checkpointing.  A misspelled strategy or option raises here.
    """
    kind = _model_kind(model)
    if kind == "keras3":
        keras = sys.modules["keras"]
        if keras.backend.backend() != "tensorflow":
            raise ValueError(
                "memory_saving_gradients.keras.enable needs the TensorFlow backend of "
                f"Keras 3; this process uses {keras.backend.backend()!r} "
                "(set KERAS_BACKEND=tensorflow before importing keras)."
            )
    if not isinstance(checkpoints, str):
        raise TypeError(
            "enable() takes a strategy name (e.g. 'memory', 'speed'): Keras builds the "
            "graph later, so tensors cannot be named in advance."
        )
    record = reporting.Record(where=f"Keras model {model.name!r}")
    config = tape_lib.Config.of(checkpoints, options, record)  # raises before any change
    if is_enabled(model):
        disable(model)
    own_step = model.train_step  # bound: the class's, or an instance attribute

    def train_step(data):
        if tf.executing_eagerly():
            _warn_eager(model, record)
            return own_step(data)
        with tape_hooks.scope(config):
            return own_step(data)

    had_own = "train_step" in model.__dict__  # an instance attribute to put back
    setattr(model, _ATTRIBUTE, (dict(options, checkpoints=checkpoints), had_own, own_step, record))
    model.train_step = train_step
    model.train_function = None  # rebuilt on the next fit()
    return model


def disable(model):
    """Undo :func:`enable`: ``fit`` uses the model's own train step again."""
    state = getattr(model, _ATTRIBUTE, None)
    if state is None:
        return model
    delattr(model, _ATTRIBUTE)
    _, had_own, own_step, _ = state
    if had_own:
        model.train_step = own_step
    else:
        model.__dict__.pop("train_step", None)
    model.train_function = None
    return model


def plans(model) -> list:
    """The :class:`~memory_saving_gradients.Plan` of every train step of ``model``
    rewritten since :func:`enable` (empty if none, or if it is not enabled)."""
    state = getattr(model, _ATTRIBUTE, None)
    return [] if state is None else state[3].plans


def _warn_eager(model, record: reporting.Record) -> None:
    """Once per enable: the model's train step runs eagerly, nothing is rewritten."""
    reporting.ran_eagerly(record)
    if record.warned:
        return
    record.warned = True
    warnings.warn(
        f"Keras model {model.name!r} runs its train step eagerly (compiled with "
        "run_eagerly=True): nothing can be recomputed in eager mode, so it trains with "
        "plain gradients (no memory saved). Compile it with run_eagerly=False to save "
        "memory.",
        notices.EagerExecutionWarning, stacklevel=3,
    )


def is_enabled(model) -> bool:
    """Whether :func:`enable` is in effect for ``model``."""
    return getattr(model, _ATTRIBUTE, None) is not None


def _model_kind(model) -> str:
    """``'keras3'`` or ``'tf_keras'``; TypeError for anything else."""
    keras = sys.modules.get("keras")
    if keras is None:
        try:
            import keras  # noqa: F811
        except ImportError:  # pragma: no cover
            keras = None
    if keras is not None and getattr(keras, "__version__", "").startswith("3."):
        if isinstance(model, keras.Model):
            return "keras3"
    for name in ("tf_keras", "keras"):  # tf_keras, or Keras 2 installed as keras
        module = sys.modules.get(name)
        if module is not None and not getattr(module, "__version__", "3").startswith("3."):
            if isinstance(model, module.Model):
                return "tf_keras"
    raise TypeError(
        f"enable() takes a Keras 3 or tf_keras model; got {type(model).__name__}. "
        "For any other training code, use memory_saving_gradients.patch() (or "
        "`with memory_saving_gradients.patched():`), which makes every "
        "tf.GradientTape checkpoint while a graph is traced."
    )

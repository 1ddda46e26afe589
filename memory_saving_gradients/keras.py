"""Keras 3 (TensorFlow backend): ``model.fit`` with memory-saving gradients.

``enable(model, checkpoints='memory', **options)`` gives the model a
``train_step`` that is Keras' own (Keras 3.x, TensorFlow backend: forward
pass, ``compute_loss``, loss tracker, loss scaling, ``optimizer.apply_gradients``,
``compute_metrics``) except that the tape is
:class:`memory_saving_gradients.GradientTape`.  ``fit`` runs the step inside
the ``tf.function`` Keras builds, so the backward pass is rewritten there.

Batch normalization and dropout need nothing special: moving-statistics
updates and the dropout seed's variable are stateful ops, which are never
recomputed (their outputs are kept), and Keras' dropout draws its mask with a
stateless op from that kept seed, so a recomputed mask equals the original.

``run_eagerly=True`` trains normally (a warning is logged: nothing can be
rewritten eagerly).  With ``jit_compile=True`` (Keras' default where a GPU is
visible) the step trains correctly but XLA merges the recomputed copies back
into the forward pass, so nothing is saved; ``enable`` logs a warning.

Keras is imported only when this module's functions are called.
"""

from __future__ import annotations

import logging
import types
import warnings

from ._tensorflow import tf
from .tape import GradientTape

logger = logging.getLogger("memory_saving_gradients")

_ATTRIBUTE = "_memory_saving_gradients_options"


def enable(model, checkpoints="memory", **options):
    """Make ``model.fit`` (and ``train_on_batch``) train with memory-saving gradients.

    Args:
      model: a ``keras.Model`` using the TensorFlow backend whose class does
        not override ``train_step`` (with a custom ``train_step``, use
        :class:`memory_saving_gradients.GradientTape` in it instead).
      checkpoints, **options: as for :func:`memory_saving_gradients.gradients`.

    Returns:
      The model (changed in place).  :func:`disable` undoes it.
    """
    keras = _import_keras()
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            "memory_saving_gradients.keras.enable needs the TensorFlow backend of "
            f"Keras 3; this process uses {keras.backend.backend()!r} "
            "(set KERAS_BACKEND=tensorflow before importing keras)."
        )
    if not isinstance(model, keras.Model):
        raise TypeError(f"enable() takes a keras.Model; got {type(model).__name__}.")
    trainer_step = _tensorflow_trainer().train_step
    class_step = getattr(type(model), "train_step", None)
    if class_step is not trainer_step:
        raise ValueError(
            f"{type(model).__name__} overrides train_step, so enable() cannot replace "
            "it without losing your changes. In your train_step, use "
            "`memory_saving_gradients.GradientTape(checkpoints=...)` in place of "
            "`tf.GradientTape`."
        )
    if not isinstance(checkpoints, str):
        raise TypeError(
            "enable() takes a strategy name (e.g. 'memory', 'speed'): Keras builds the "
            "graph later, so tensors cannot be named in advance."
        )
    if getattr(model, "jit_compile", False) is True:
        logger.warning(
            "memory_saving_gradients.keras.enable: this model compiles its train step "
            "with XLA (jit_compile=True, Keras' default on GPUs), and XLA merges the "
            "recomputed copies back into the forward pass, so no memory is saved. "
            "Use model.compile(..., jit_compile=False) to save memory."
        )
    setattr(model, _ATTRIBUTE, dict(options, checkpoints=checkpoints))
    model.train_step = types.MethodType(_train_step, model)
    model.train_function = None  # rebuilt on the next fit()
    return model


def disable(model):
    """Undo :func:`enable`: ``fit`` uses Keras' own train step again."""
    if getattr(model, _ATTRIBUTE, None) is None:
        return model
    delattr(model, _ATTRIBUTE)
    model.__dict__.pop("train_step", None)
    model.train_function = None
    return model


def is_enabled(model) -> bool:
    """Whether :func:`enable` is in effect for ``model``."""
    return getattr(model, _ATTRIBUTE, None) is not None


def _train_step(self, data):
    """Keras 3's TensorFlow ``train_step`` with a memory-saving tape."""
    keras = _import_keras()
    options = dict(getattr(self, _ATTRIBUTE))
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with GradientTape(**options) as tape:
        if getattr(self, "_call_has_training_arg", True):
            y_pred = self(x, training=True)
        else:
            y_pred = self(x)
        loss = _compute_loss(self, x, y, y_pred, sample_weight)
        tracker = getattr(self, "_loss_tracker", None)
        if tracker is not None:
            batch = tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]
            tracker.update_state(_unscale_loss(loss), sample_weight=batch)
        if self.optimizer is not None:
            loss = self.optimizer.scale_loss(loss)
    if self.trainable_weights:
        trainable_weights = self.trainable_weights
        gradients = tape.gradient(loss, trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, trainable_weights))
    else:
        warnings.warn("The model does not have any trainable weights.")
    return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _compute_loss(model, x, y, y_pred, sample_weight):
    compute = getattr(model, "_compute_loss", None)  # Keras >= 3.3: handles `training`
    if compute is not None:
        return compute(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)


def _unscale_loss(loss):
    try:
        from keras.src.losses.loss import unscale_loss_for_distribution
    except ImportError:  # pragma: no cover - other Keras 3 layouts
        return loss
    return unscale_loss_for_distribution(loss)


def _tensorflow_trainer():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer


def _import_keras():
    try:
        import keras
    except ImportError as error:  # pragma: no cover
        raise ImportError("memory_saving_gradients.keras needs Keras 3: pip install keras") from error
    if not keras.__version__.startswith("3."):
        raise ImportError(
            f"memory_saving_gradients.keras supports Keras 3; found {keras.__version__}."
        )
    return keras

"""Keras: ``model.fit`` with memory-saving gradients, for Keras 3 and tf_keras models.

Layer: entry points; imports: batch, notices, reporting, tape, tape_hooks, _tensorflow,
checkpointing (when called) (planning for type hints only).

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
from typing import TYPE_CHECKING, Any, Sequence, Union

from . import _tensorflow as _tf_internals
from . import batch as batch_lib
from . import notices, reporting, tape_hooks
from . import tape as tape_lib
from ._tensorflow import tf

if TYPE_CHECKING:
    import keras as _keras3
    import tf_keras

    from .planning import Plan

    #: What these functions take: a Keras 3 model (TensorFlow backend) or a tf_keras one.
    Model = Union[_keras3.Model, tf_keras.Model]
#: An input spec: one ``tf.TensorSpec``, or one per input.
InputSpec = Union[tf.TensorSpec, Sequence[tf.TensorSpec]]

logger = logging.getLogger("memory_saving_gradients")

_ATTRIBUTE = "_memory_saving_gradients_options"


def enable(model: Model, checkpoints: str = "memory", **options: Any) -> Model:
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
            f"enable() takes a strategy name (e.g. 'memory', 'speed'); got "
            f"{type(checkpoints).__name__} {checkpoints!r:.60}. Keras builds the graph later, "
            "so tensors cannot be named in advance."
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


def disable(model: Model) -> Model:
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


def plans(model: Model) -> list[Plan]:
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
    notices.warn(
        f"Keras model {model.name!r} runs its train step eagerly (compiled with "
        "run_eagerly=True): nothing can be recomputed in eager mode, so it trains with "
        "plain gradients (no memory saved). Compile it with run_eagerly=False to save "
        "memory.",
        notices.EagerExecutionWarning
    )


def is_enabled(model: Model) -> bool:
    """Whether :func:`enable` is in effect for ``model``."""
    return getattr(model, _ATTRIBUTE, None) is not None


def _model_kind(model) -> str:
    """``'keras3'`` or ``'tf_keras'``; TypeError for anything else."""
    keras = sys.modules.get("keras")
    if keras is None:
        try:
            import keras
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


#: Input batches counted as alive during a step.  A ``tf.data`` pipeline holds the
#: batch being trained on, the ones its autotuned prefetch buffer (injected by
#: default) has ready, and the one it is assembling.  Measured on the MLP of
#: tests/test_largest_batch.py (docs/planner.md): iterating a ``.batch()`` pipeline
#: held 2.4 batches at its peak, and Keras ``fit`` on one held about 2 to 5 batches beyond
#: the step; the count leaves room for that spread.  Pass ``input_batches`` to
#: :func:`largest_batch` for a pipeline whose buffers you know.
INPUT_BATCHES = 5


def step_plan(model: Model, checkpoints: str = "memory", input_spec: InputSpec | None = None) -> Plan:
    """The :class:`~memory_saving_gradients.Plan` of one training step of ``model``,
    traced once on its input spec with the batch dimension unknown.

    The step is the model's forward pass in training mode and the gradient of
    its outputs' mean square with respect to its trainable weights (the loss
    adds a few tensors of the outputs' size; it is not the compiled one,
    whose labels this function has no shape for).  ``input_spec``: a
    ``tf.TensorSpec`` (or a list of them, one per input) when the model has no
    ``inputs`` (a subclassed model never called on a ``keras.Input``).
    """
    _model_kind(model)
    specs = _input_specs(model, input_spec)
    structure = _input_structure(model, len(specs)) if input_spec is None else None
    found = []

    def step(*inputs):
        from . import checkpointing

        if structure is not None:  # a dict of inputs, as the model was built on
            arguments = tf.nest.pack_sequence_as(structure, list(inputs))
        else:
            arguments = inputs[0] if len(inputs) == 1 else list(inputs)
        outputs = model(arguments, training=True)
        loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, tf.float32)))
                         for o in tf.nest.flatten(outputs)])
        found.append(checkpointing.plan(loss, list(model.trainable_variables), checkpoints))
        return loss

    tf.function(step, input_signature=specs, autograph=False).get_concrete_function()
    return found[-1]


def largest_batch(model: Model, memory: float | None = None, checkpoints: str | None = "memory",
                  input_spec: InputSpec | None = None, headroom: float | None = None,
                  input_batches: int = INPUT_BATCHES) -> int:
    """The largest batch whose predicted training step fits ``memory`` bytes.

    What must fit: the model's variables and its optimizer's slot variables
    (the optimizer is built if it is not yet, as ``fit`` would), ``input_batches``
    input batches (:data:`INPUT_BATCHES` unless given) with targets the size of
    the outputs, and the step's predicted peak
    (:func:`step_plan`, with ``headroom`` added), with ``checkpoints`` (a
    strategy name; None for plain ``tf.gradients``).

    ``memory`` defaults to the free memory of the first GPU TensorFlow sees
    (its allocator's limit minus what it holds); without a GPU it must be
    given.  Returns 0 when not even a batch of one fits.
    """
    if input_batches < 1:
        raise ValueError(f"largest_batch: input_batches={input_batches!r}; at least the batch "
                         "being trained on is alive, so pass 1 or more.")
    if memory is None:
        memory = device_free_memory()
    batch_lib.checked_bytes(memory, "largest_batch: memory")
    plan = step_plan(model, checkpoints or "memory", input_spec)
    fixed = model_bytes(model)
    per_example = sum(_bytes_per_example(s) for s in _input_specs(model, input_spec))
    per_example += sum(_bytes_per_example(o) for o in tf.nest.flatten(_output_specs(model)))
    per_example *= input_batches
    room = memory - fixed
    if room <= 0:
        return 0
    return plan.largest_batch(room, plain=checkpoints is None, per_example_bytes=per_example,
                              headroom=headroom)


def device_free_memory(device: str = "GPU:0") -> int:
    """Bytes TensorFlow's allocator can still hand out on ``device``: its limit (the
    ``memory_limit`` TensorFlow reports for the device) minus what it holds now.
    ValueError where TensorFlow sees no GPU."""
    if not _tf_internals.gpu_visible():
        raise ValueError(
            "largest_batch: no GPU is visible, so there is no device memory to default to; "
            "pass memory=<bytes> (e.g. memory=4 * 2**30)."
        )
    index = int(device.rsplit(":", 1)[-1])
    limit = _tf_internals.gpu_memory_limits()[index]
    held = tf.config.experimental.get_memory_info(device)["current"]
    return max(0, limit - held)


def _input_specs(model, input_spec) -> list:
    if input_spec is not None:
        specs = list(input_spec) if isinstance(input_spec, (list, tuple)) else [input_spec]
    else:
        inputs = getattr(model, "inputs", None)
        if not inputs:
            raise ValueError(
                f"{type(model).__name__} has no inputs (never called on keras.Input): pass "
                "input_spec=tf.TensorSpec([None, ...], dtype) for one example batch."
            )
        specs = [tf.TensorSpec(t.shape, getattr(t.dtype, "name", t.dtype)) for t in inputs]
    return [tf.TensorSpec([None] + list(s.shape)[1:], s.dtype) for s in specs]


def _input_structure(model, count: int):
    """The nesting of the model's inputs (a dict, a nested list), where it is more than
    a list of ``count`` tensors, so that the model is called as it was built; else None."""
    try:
        structure = model.input
    except (AttributeError, ValueError):  # a model never called on keras.Input
        return None
    if isinstance(structure, (list, tuple)) or not tf.nest.is_nested(structure):
        return None
    return structure if len(tf.nest.flatten(structure)) == count else None


def _output_specs(model) -> list:
    outputs = getattr(model, "outputs", None) or []
    return [tf.TensorSpec([None] + list(t.shape)[1:], getattr(t.dtype, "name", t.dtype))
            for t in outputs]


def _bytes_per_example(spec) -> int:
    count = 1
    for d in list(spec.shape)[1:]:
        count *= int(d or 1)
    return count * tf.as_dtype(spec.dtype).size


def model_bytes(model: Model) -> int:
    """Bytes of the model's variables and its optimizer's (built here if needed)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not getattr(optimizer, "built", True):
        optimizer.build(model.trainable_variables)
    variables = list(model.variables) + list(getattr(optimizer, "variables", []) or [])
    if callable(getattr(optimizer, "variables", None)):  # tf_keras legacy optimizers
        variables = list(model.variables) + list(optimizer.variables())
    seen, total = set(), 0
    for v in variables:
        key = id(v)
        if key in seen:
            continue
        seen.add(key)
        count = 1
        for d in v.shape:
            count *= int(d)
        total += count * tf.as_dtype(getattr(v.dtype, "name", v.dtype)).size
    return total

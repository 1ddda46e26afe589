"""Worker process for tests/test_applications.py: one keras.applications model.

``applications_worker.py MODEL BATCH SIZE [VARIANTS]``

Builds ``keras.applications.MODEL`` (random weights, SIZE x SIZE x 3 input, 10
classes) and, in one ``tf.function`` per variant, the gradients of the loss
with respect to ``model.trainable_variables``:

- ``plain``: ``tf.gradients`` (the reference), and the same graph run on the
  input moved by 1e-6 of itself: how much the model's own round-off moves its
  gradients (its sensitivity);
- ``memory``, ``balanced``, ``speed``: ``memory_saving_gradients.gradients``
  with that strategy;
- ``budget``: ``checkpoints='memory'`` with a ``memory_budget`` half-way
  between the plan's predicted least peak and plain ``tf.gradients``' peak;
- ``list``: the output of every 10th layer as checkpoints.

VARIANTS (comma-separated) chooses among the last five; default all.

TF_ENABLE_ONEDNN_OPTS is read once, at import: the caller sets it.  Prints one
JSON line: per variable, the largest absolute gradient and the largest change
the moved input makes; per variant, per variable the largest absolute
difference from ``plain`` (or the error it raised) and its seconds (trace,
plan and first run); and whether oneDNN was on.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients import _tensorflow

STRATEGIES = ("memory", "balanced", "speed", "budget", "list")


def _layer_outputs(model, every: int = 10) -> keras.Model:
    """A model with the same weights whose outputs are every ``every``-th layer's output
    and the prediction (one forward pass computes all of them)."""
    chosen = [layer.output for layer in model.layers[1:-1:every]]
    return keras.Model(model.inputs, chosen + [model.output])


def _forward_tensor(t: tf.Tensor) -> tf.Tensor:
    """The tensor a model output stands for: Keras may end an output in an identity."""
    while t.op.type == "Identity" and t.op.inputs:
        t = t.op.inputs[0]
    return t


def _step(model, loss_fn, variant: str):
    with_layers = _layer_outputs(model) if variant == "list" else None

    @tf.function  # autograph on, as users trace (plan() and gradients() opt out of it)
    def step(x, y):
        if with_layers is not None:
            *hidden, prediction = with_layers(x, training=True)
        else:
            prediction = model(x, training=True)
        loss = loss_fn(y, prediction)
        xs = model.trainable_variables
        if variant in ("plain", "moved"):
            return tf.gradients(loss, xs)
        if variant == "list":
            return msg.gradients(loss, xs, checkpoints=[_forward_tensor(h) for h in hidden])
        if variant == "budget":
            the_plan = msg.plan(loss, xs, checkpoints="memory")
            budget = (the_plan.predicted_peak_bytes + the_plan.baseline_peak_bytes) / 2
            return msg.gradients(loss, xs, checkpoints="memory", memory_budget=budget)
        return msg.gradients(loss, xs, checkpoints=variant)

    return step


def _differences(got, want) -> list:
    """Per variable, the largest absolute difference (0 where either is None)."""
    return [float(tf.reduce_max(tf.abs(tf.convert_to_tensor(g) - tf.convert_to_tensor(w))))
            if g is not None and w is not None else 0.0 for g, w in zip(got, want)]


def main() -> None:
    name, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    variants = sys.argv[4].split(",") if len(sys.argv) > 4 else list(STRATEGIES)
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(
        weights=None, input_shape=(size, size, 3), classes=10)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, size, size, 3)).astype("float32")
    y = tf.constant(rng.integers(0, 10, batch).astype("int32"))
    noise = np.random.default_rng(1).standard_normal(x.shape).astype("float32")
    out = {"model": name, "onednn": _tensorflow.onednn_enabled(), "variants": {}}
    # every call starts from the same variables: the same dropout masks (Keras' seed
    # generators are variables) and batch-norm statistics
    initial = [v.numpy() for v in model.variables]

    def fresh(step):
        def call(inputs, labels):
            for v, value in zip(model.variables, initial):
                v.assign(value)
            return step(inputs, labels)
        call.step = step
        return call

    plain = fresh(_step(model, loss_fn, "plain"))
    start = time.perf_counter()
    want = plain(tf.constant(x), y)
    out["plain_seconds"] = round(time.perf_counter() - start, 1)
    out["largest"] = [float(tf.reduce_max(tf.abs(w))) if w is not None else 0.0 for w in want]
    # the same graph on an input moved by 1e-6 of itself: the model's own sensitivity
    out["moved"] = _differences(plain(tf.constant(x * (1 + 1e-6 * noise)), y), want)
    for variant in variants:
        start = time.perf_counter()
        call = fresh(_step(model, loss_fn, variant))
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", msg.MemorySavingGradientsWarning)
                got = call(tf.constant(x), y)
        except Exception as error:  # reported to the test, which fails on it
            out["variants"][variant] = {"error": f"{type(error).__name__}: {str(error)[-1500:]}"}
            continue
        traced = call.step.get_concrete_function(tf.constant(x), y).graph  # the same trace
        out["variants"][variant] = {
            "differences": _differences(got, want),
            "none_pattern_differs": [g is None for g in got] != [w is None for w in want],
            "seconds": round(time.perf_counter() - start, 1),
            # what the library said, and how many recomputed copies the step holds
            "notices": sorted({w.category.__name__ for w in caught
                               if issubclass(w.category, msg.MemorySavingGradientsWarning)}),
            "recomputed_ops": sum("/recompute_" in op.name for op in traced.get_operations()),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The one line saves memory where the batch is unknown when the step is traced.

Four ways users train with a batch of ``None``: Keras 3 ``fit`` on a
``tf.data`` pipeline batched without ``drop_remainder`` (a partial last
batch), tf_keras ``fit`` on the same, a custom loop with
``input_signature=[tf.TensorSpec([None, ...])]``, and a v1 graph with a
``[None, ...]`` placeholder.  Each on a weight-heavy MLP (its weights outweigh
its activations at batch 32, the size the planner used to assume) and on a
conv net, with ``patched("memory")`` and no ``batch_size``: the step's own
peak (the allocator's, above what it held before: variables and slots are
not counted) is at most ``RATIO`` of plain ``tf.gradients``'.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients import profiling

pytestmark = [pytest.mark.keras, pytest.mark.memory]

keras = pytest.importorskip("keras")

RATIO = 0.75

#: A 16 x Dense(256) MLP fed at batch 2048: 4 MB of weights; 2 MB per activation.
MLP = dict(kind="mlp", width=256, depth=16, batch=2048)
#: Six 3x3 convolutions with batch norm at 16x16, batch 256.
CONV = dict(kind="conv", image=16, channels=16, depth=6, batch=256)
CLASSES = 10


def _data(size, batches=2.5, seed=0):
    """``batches`` batches of examples: the last one partial."""
    rng = np.random.default_rng(seed)
    n = int(size["batch"] * batches)
    if size["kind"] == "mlp":
        x = rng.standard_normal((n, size["width"])).astype("float32")
    else:
        x = rng.standard_normal((n, size["image"], size["image"], 3)).astype("float32")
    return x, rng.integers(0, CLASSES, n).astype("int32")


def _keras_model(kmod, size):
    kmod.utils.set_random_seed(0)
    layers = kmod.layers
    if size["kind"] == "mlp":
        stack = [kmod.Input((size["width"],))]
        stack += [layers.Dense(size["width"], activation="relu") for _ in range(size["depth"])]
    else:
        stack = [kmod.Input((size["image"], size["image"], 3))]
        for _ in range(size["depth"]):
            stack += [layers.Conv2D(size["channels"], 3, padding="same", use_bias=False),
                      layers.BatchNormalization(), layers.ReLU()]
        stack.append(layers.GlobalAveragePooling2D())
    model = kmod.Sequential(stack + [layers.Dense(CLASSES)])
    model.compile(optimizer=kmod.optimizers.SGD(0.01, momentum=0.9),
                  loss=kmod.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit_peak(kmod, size, patched: bool) -> int:
    """fit's own allocator peak over an epoch with a partial last batch (after a
    warm-up fit that traces both batch shapes)."""
    model = _keras_model(kmod, size)
    x, y = _data(size)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(size["batch"])
    with msg.patched("memory") if patched else contextlib.nullcontext():
        model.fit(data, verbose=0)  # traced (and rewritten) here
    return msg.peak_memory_during(lambda: model.fit(data, verbose=0))


def _custom_loop_peak(size, patched: bool) -> int:
    model = _keras_model(keras, size)
    optimizer = keras.optimizers.SGD(0.01)
    x, y = _data(size, batches=1)
    shape = [None] + list(x.shape[1:])

    @tf.function(input_signature=[tf.TensorSpec(shape, tf.float32),
                                  tf.TensorSpec([None], tf.int32)])
    def step(inputs, labels):
        with tf.GradientTape() as tape:
            logits = model(inputs, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x, y = tf.constant(x), tf.constant(y)
    with msg.patched("memory") if patched else contextlib.nullcontext():
        step(x, y)  # traced here
    return msg.peak_memory_during(lambda: step(x, y))


def _v1_graph_peak(size, patched: bool) -> int:
    """A v1 graph with a [None, ...] placeholder; the traced step's peak."""
    x, y = _data(size, batches=1)
    rng = np.random.default_rng(1)
    with tf.Graph().as_default():
        inputs = tf.compat.v1.placeholder(tf.float32, [None] + list(x.shape[1:]))
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        h, weights = inputs, []
        if size["kind"] == "mlp":
            for _ in range(size["depth"]):
                w = tf.Variable((rng.standard_normal((size["width"],) * 2)
                                 * np.sqrt(2.0 / size["width"])).astype("float32"))
                weights.append(w)
                h = tf.nn.relu(tf.matmul(h, w))
        else:
            channels = 3
            for _ in range(size["depth"]):
                w = tf.Variable((rng.standard_normal((3, 3, channels, size["channels"]))
                                 * 0.2).astype("float32"))
                weights.append(w)
                h = tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))
                channels = size["channels"]
            h = tf.reduce_mean(h, axis=[1, 2])
        w = tf.Variable((rng.standard_normal((int(h.shape[-1]), CLASSES)) * 0.1)
                        .astype("float32"))
        weights.append(w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=tf.matmul(h, w)))
        with msg.patched("memory") if patched else contextlib.nullcontext():
            grads = tf.compat.v1.gradients(loss, weights)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            _, metadata = profiling.traced_run(session, grads, {inputs: x, labels: y})
    return sum(msg.peak_memory(metadata).values())


def _peak(case, size, patched):
    if case == "keras3_fit":
        return _fit_peak(keras, size, patched)
    if case == "tf_keras_fit":
        tf_keras = pytest.importorskip("tf_keras")
        return _fit_peak(tf_keras, size, patched)
    if case == "custom_loop":
        return _custom_loop_peak(size, patched)
    return _v1_graph_peak(size, patched)


@pytest.mark.slow
@pytest.mark.parametrize("size", [MLP, CONV], ids=["mlp", "conv"])
@pytest.mark.parametrize("case", ["keras3_fit", "tf_keras_fit", "custom_loop", "v1_graph"])
def test_one_line_saves_memory_with_an_unknown_batch(case, size):
    plain = _peak(case, size, patched=False)
    ours = _peak(case, size, patched=True)
    print(f"{case} {size['kind']}: {ours / 2**20:.1f} MiB against {plain / 2**20:.1f} MiB plain "
          f"({ours / plain:.2f}x)")
    assert plain > 0
    assert ours <= RATIO * plain, (ours / 2**20, plain / 2**20)

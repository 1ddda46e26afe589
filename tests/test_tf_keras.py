"""tf_keras (Keras 2) models: ``fit`` through ``keras.enable`` and through ``patched()``.

tf_keras is imported by its own name, which works next to Keras 3 in one
process without ``TF_USE_LEGACY_KERAS`` (the rest of the suite keeps Keras 3
as ``tf.keras``).  Each test trains a few batches plain and with the library
from the same seed and data: Keras' running loss after every batch must be
equal, and the allocator's peak of the timed steps at most 80% of plain's
(TensorFlow's CPU allocator statistics; bytes beyond those in use before the
steps).  The legacy v1 path (a tf_keras model built in a ``tf.compat.v1``
graph, legacy optimizer, whose ``get_gradients`` calls
``tensorflow.compat.v2.compat.v1.gradients``) is measured from the allocation
records of its last traced ``Session.run``.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import tensorflow as tf

tf_keras = pytest.importorskip(
    "tf_keras", reason="tf_keras is not installed; ./run_all_tests.sh installs it with "
    "pip install --no-deps 'tf-keras==2.21.*' (its metadata asks for the full tensorflow wheel)")

import memory_saving_gradients as msg  # noqa: E402
from bench import keras_suite  # noqa: E402
from memory_saving_gradients import profiling  # noqa: E402

pytestmark = pytest.mark.keras

#: conv net: 8 x (3x3 conv 8 channels - batch norm - ReLU) at 32 px, batch 32
CONV_SIZE = dict(batch=32, image=32, channels=8, depth=8, classes=10, warm_steps=1, steps=2)
PEAK_RATIO = 0.8


def _assert_same_losses(got, want, what):
    assert len(got) == len(want), what
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=what)


def test_importing_tf_keras_leaves_keras_3_as_tf_keras_module():
    import keras

    assert tf_keras.__version__.startswith("2.")
    assert keras.__version__.startswith("3.")
    assert tf.keras.Model is keras.Model


@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.parametrize("variant", ["enable", "patched"])
def test_functional_fit_same_losses_and_lower_peak(variant):
    plain = keras_suite.run_case("tf_keras_fit", "plain", CONV_SIZE)
    got = keras_suite.run_case("tf_keras_fit", variant, CONV_SIZE)
    _assert_same_losses(got["losses"], plain["losses"], variant)
    assert plain["alloc_peak_mb"] is not None, "TensorFlow's CPU allocator keeps no statistics"
    assert got["alloc_peak_mb"] <= PEAK_RATIO * plain["alloc_peak_mb"], (
        f"{variant}: allocator peak {got['alloc_peak_mb']:.1f} MiB, plain "
        f"{plain['alloc_peak_mb']:.1f} MiB")


def _sequential(size, seed=0):
    tf_keras.utils.set_random_seed(seed)
    layers = tf_keras.layers
    stack = [tf_keras.Input((size["image"], size["image"], 3))]
    for _ in range(size["depth"]):
        stack += [layers.Conv2D(size["channels"], 3, padding="same", use_bias=False),
                  layers.BatchNormalization(), layers.ReLU(), layers.Dropout(0.2)]
    stack += [layers.GlobalAveragePooling2D(), layers.Dense(size["classes"])]
    return keras_suite.compile_conv_net(tf_keras, tf_keras.Sequential(stack))


def _fit_sequential(variant):
    size = CONV_SIZE
    model = _sequential(size)
    if variant == "enable":
        msg.keras.enable(model)
    x, y = keras_suite.conv_data(size, size["warm_steps"] + size["steps"])
    b = size["batch"]

    def data(part, n):
        start = 0 if part == 0 else size["warm_steps"] * b
        return x[start:start + n * b], y[start:start + n * b]

    with msg.patched() if variant == "patched" else contextlib.nullcontext():
        return keras_suite.fit_and_measure(tf_keras, model, data, size["warm_steps"],
                                           size["steps"], batch_size=b)


@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.parametrize("variant", ["enable", "patched"])
def test_sequential_with_dropout_fit_on_numpy_same_losses_and_lower_peak(variant):
    plain = _fit_sequential("plain")
    got = _fit_sequential(variant)
    _assert_same_losses(got["losses"], plain["losses"], variant)
    assert got["alloc_peak_mb"] <= PEAK_RATIO * plain["alloc_peak_mb"], (
        f"{variant}: allocator peak {got['alloc_peak_mb']:.1f} MiB, plain "
        f"{plain['alloc_peak_mb']:.1f} MiB")


def _fit_v1_graph(patched: bool):
    """tf_keras in a v1 graph (training_v1), legacy SGD: returns (losses, peak bytes of
    the last step, from its allocation records).

    Conv - ReLU only: in a v1 graph Keras' learning phase is a placeholder, so batch
    norm and dropout become ``If`` ops (cond_v2 on the learning phase), and the
    planner keeps nothing across them (measured: 17.8 MB both ways with batch norm;
    docs/keras.md, "Where it saves nothing").
    """
    size = CONV_SIZE
    with tf.Graph().as_default():
        tf_keras.utils.set_random_seed(0)
        layers = tf_keras.layers
        stack = [tf_keras.Input((size["image"], size["image"], 3))]
        for _ in range(size["depth"]):
            stack += [layers.Conv2D(size["channels"], 3, padding="same"), layers.ReLU()]
        model = tf_keras.Sequential(
            stack + [layers.GlobalAveragePooling2D(), layers.Dense(size["classes"])])
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        metadata = tf.compat.v1.RunMetadata()
        model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.01, momentum=0.9),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      options=options, run_metadata=metadata)
        x, y = keras_suite.conv_data(size, 3)
        losses = []
        callback = tf_keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
        with msg.patched() if patched else contextlib.nullcontext():
            model.fit(x, y, batch_size=size["batch"], epochs=1, shuffle=False, verbose=0,
                      callbacks=[callback])
        assert type(model).__module__.startswith("tf_keras"), type(model)
        return losses, sum(profiling.peak_memory(metadata).values())


@pytest.mark.memory
def test_legacy_v1_optimizer_in_a_v1_graph_goes_through_the_patch():
    want, plain_peak = _fit_v1_graph(patched=False)
    got, our_peak = _fit_v1_graph(patched=True)
    _assert_same_losses(got, want, "v1 graph, legacy SGD")
    assert plain_peak > 0
    assert our_peak <= PEAK_RATIO * plain_peak, (
        f"last step's peak {our_peak / 2**20:.1f} MiB, plain {plain_peak / 2**20:.1f} MiB")

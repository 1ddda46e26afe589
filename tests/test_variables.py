"""xs of every kind tf.compat.v1.gradients accepts: one test per kind.

tf.Variable (a tf.Module's), Keras 3 variables (float32 and mixed
precision), tf_keras variables and AutoCastVariable, resource-variable
handles and tensors; distributed (mirrored) variables are in
tests/test_distribute.py, which passes them as xs.  Each goes through
gradients(), plan(), GradientTape and the patched tf.gradients inside a
tf.function, and the gradients equal tf.compat.v1.gradients'.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

import memory_saving_gradients as msg

WIDTH, DEPTH, BATCH = 32, 6, 256


def _inputs():
    return tf.random.stateless_normal([BATCH, WIDTH], seed=[2, 3])


def _check(loss_fn, variables, sources=None):
    """Inside one tf.function: gradients() ('speed' and 'memory'), plan(), the patched
    tf.gradients and GradientTape against tf.compat.v1.gradients; values equal and the
    rewrite really happened ('speed' keeps the matmuls, so the tanhs are recomputed;
    with one tanh a layer it would save nothing and fall back to plain tf.gradients)."""
    sources = variables if sources is None else sources

    @tf.function
    def run():
        loss = loss_fn()
        want = tf.compat.v1.gradients(loss, sources)
        speed = msg.gradients(loss, sources, checkpoints="speed")
        memory = msg.gradients(loss, sources, checkpoints="memory")
        the_plan = msg.plan(loss, sources, checkpoints="speed")
        assert the_plan.checkpoints, the_plan
        with msg.patched("speed", tape=False):
            patched = tf.gradients(loss, sources)
        with msg.GradientTape(checkpoints="speed") as tape:
            taped_loss = loss_fn()
        taped = tape.gradient(taped_loss, variables)
        return want, speed, memory, patched, taped

    graph = run.get_concrete_function().graph
    assert any("recompute" in op.name and op.type == "Tanh" for op in graph.get_operations())
    want, *ours = run()
    for got in ours:
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a is not None and b is not None
            a, b = np.asarray(tf.convert_to_tensor(a)), np.asarray(tf.convert_to_tensor(b))
            scale = max(1.0, float(np.abs(b).max()))
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-3 * scale)


def _tanh_stack(matmul_weights, x, dtype=tf.float32):
    h = tf.cast(x, dtype)
    for w in matmul_weights:  # two tanhs a layer: 'speed' (keep the matmuls) then saves memory
        h = tf.tanh(tf.tanh(tf.matmul(h, tf.cast(w, dtype))))
    return tf.reduce_sum(tf.cast(h, tf.float32) ** 2)


def test_tf_module_variables():
    class Stack(tf.Module):
        def __init__(self):
            super().__init__()
            self.ws = [tf.Variable(tf.random.stateless_normal([WIDTH, WIDTH], seed=[i, 1]) * 0.3)
                       for i in range(DEPTH)]

    module, x = Stack(), _inputs()
    _check(lambda: _tanh_stack(module.ws, x), list(module.trainable_variables))


def _keras3_model(keras):
    keras.utils.set_random_seed(0)
    stack = [keras.Input((WIDTH,))]
    for _ in range(DEPTH):  # two tanhs a layer, as _tanh_stack
        stack += [keras.layers.Dense(WIDTH, activation="tanh"), keras.layers.Activation("tanh")]
    return keras.Sequential(stack + [keras.layers.Dense(1)])


@pytest.mark.keras
def test_keras3_variables():
    keras = pytest.importorskip("keras")
    model, x = _keras3_model(keras), _inputs()
    assert not isinstance(model.trainable_variables[0], tf.Variable)  # keras.Variable
    _check(lambda: tf.reduce_sum(model(x, training=True) ** 2), model.trainable_variables)


@pytest.mark.keras
def test_keras3_mixed_precision_variables():
    keras = pytest.importorskip("keras")
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = _keras3_model(keras)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    x = _inputs()
    loss = lambda: tf.reduce_sum(tf.cast(model(x, training=True), tf.float32) ** 2)  # noqa: E731
    _check(loss, model.trainable_variables)


def _tf_keras():
    return pytest.importorskip("tf_keras", reason="tf-keras is a test extra (pip install tf-keras)")


@pytest.mark.keras
def test_tf_keras_variables():
    tf_keras = _tf_keras()
    tf_keras.utils.set_random_seed(0)
    layers = [tf_keras.layers.InputLayer(input_shape=(WIDTH,))]
    for _ in range(DEPTH):  # two tanhs a layer, as _tanh_stack
        layers += [tf_keras.layers.Dense(WIDTH, activation="tanh"), tf_keras.layers.Activation("tanh")]
    model = tf_keras.Sequential(layers + [tf_keras.layers.Dense(1)])
    x = _inputs()
    _check(lambda: tf.reduce_sum(model(x, training=True) ** 2), model.trainable_variables)


@pytest.mark.keras
def test_tf_keras_autocast_variables():
    tf_keras = _tf_keras()
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        tf_keras.utils.set_random_seed(0)
        model = tf_keras.Sequential(
            [tf_keras.layers.Dense(WIDTH, activation="tanh", input_shape=(WIDTH,))
             for _ in range(DEPTH)] + [tf_keras.layers.Dense(1, dtype="float32")]
        )
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert "AutoCastVariable" in type(model.layers[0].kernel).__name__
    x = _inputs()
    _check(lambda: tf.reduce_sum(model(x, training=True) ** 2), model.trainable_variables)


def test_resource_variable_handles_and_tensors():
    ws = [tf.Variable(tf.random.stateless_normal([WIDTH, WIDTH], seed=[i, 4]) * 0.3)
          for i in range(DEPTH)]
    x = _inputs()

    @tf.function
    def run():
        handles = [w.handle for w in ws]
        reads = [tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32) for h in handles]
        scaled = reads[0] * 1.0  # a tensor x
        loss = _tanh_stack([scaled] + reads[1:], x)
        want = tf.compat.v1.gradients(loss, handles[1:] + [scaled])
        got = msg.gradients(loss, handles[1:] + [scaled], checkpoints="speed")
        return want, got

    want, got = run()
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("partitioned", [False, True])
def test_v1_reference_variables(partitioned):
    """TF1's default variables (``use_resource=False``; a partitioned one is a list of
    them): gradients() and the classic ``tf.gradients`` replacement differentiate them
    as tf.compat.v1.gradients does (its ref), and an optimizer applies the results."""
    with tf.Graph().as_default():
        x = tf.constant(np.random.RandomState(0).randn(BATCH, WIDTH).astype(np.float32))
        if partitioned:
            weights = list(tf.compat.v1.get_variable(
                "w", [WIDTH * DEPTH, WIDTH], use_resource=False,
                initializer=tf.compat.v1.random_normal_initializer(stddev=0.3, seed=1),
                partitioner=tf.compat.v1.fixed_size_partitioner(2)))
            stacked = tf.concat(weights, 0)
            layers = [stacked[i * WIDTH:(i + 1) * WIDTH] for i in range(DEPTH)]
        else:
            weights = [tf.compat.v1.Variable(
                tf.random.stateless_normal([WIDTH, WIDTH], seed=[i, 5]) * 0.3,
                use_resource=False) for i in range(DEPTH)]
            layers = weights
        assert not any(resource_variable_ops.is_resource_variable(w) for w in weights)
        loss = _tanh_stack(layers, x)
        want = tf.compat.v1.gradients(loss, weights)
        got = msg.gradients(loss, weights, checkpoints="speed")
        the_plan = msg.plan(loss, weights, checkpoints="speed")
        classic = msg.gradients_memory(loss, weights)
        step = tf.compat.v1.train.GradientDescentOptimizer(0.1).apply_gradients(
            zip(got, weights))
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            want, got, classic = session.run([want, got, classic])
            session.run(step)
    assert the_plan.recomputed_ops
    for a, b, c in zip(got, want, classic):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(c, b, rtol=1e-4, atol=1e-5)


def test_something_else_is_a_clear_type_error():
    x = _inputs()

    @tf.function
    def run():
        loss = tf.reduce_sum(tf.tanh(x))
        return msg.gradients(loss, ["not a tensor"], checkpoints="speed")

    with pytest.raises(TypeError, match="xs must be tensors or variables"):
        run()

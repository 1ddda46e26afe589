"""memory_saving_gradients.GradientTape: tf.GradientTape's results, checkpointed in tf.function."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients import tape as tape_lib

DEPTH = 12


@pytest.fixture(scope="module")
def weights():
    return [
        tf.Variable(tf.random.stateless_normal([32, 32], seed=[i, 7]) * 0.3, name=f"w{i}")
        for i in range(DEPTH)
    ]


@pytest.fixture(scope="module")
def x():
    return tf.random.stateless_normal([512, 32], seed=[3, 4])


def _forward(weights, x):
    h = x
    for w in weights:  # two tanhs a layer: 'speed' (keep the matmuls) then saves memory
        h = tf.tanh(tf.tanh(tf.matmul(h, w)))
    return tf.reduce_sum(h * h)


def _recompute_ops(fn, *args):
    graph = fn.get_concrete_function(*args).graph
    return [op.name for op in graph.get_operations() if "recompute" in op.name]


def _close(a, b):
    """Equal within float32 round-off (summation order differs between graphs)."""
    a, b = np.asarray(a), np.asarray(b)
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("checkpoints", ["memory", "speed"])
def test_values_equal_tf_gradient_tape_in_tf_function_with_nested_sources(weights, x, checkpoints):
    @tf.function
    def ours(x):
        with msg.GradientTape(checkpoints=checkpoints) as tape:
            tape.watch(x)
            loss = _forward(weights, x)
        return tape.gradient(loss, {"early": weights[:3], "late": (weights[3:], x)})

    @tf.function
    def theirs(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = _forward(weights, x)
        return tape.gradient(loss, {"early": weights[:3], "late": (weights[3:], x)})

    got, want = ours(x), theirs(x)
    tf.nest.assert_same_structure(got, want)
    for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        _close(a, b)
    copies = _recompute_ops(ours, x)
    assert copies, "no recompute copies in the tf.function graph"
    assert any(name.split("/")[-1].startswith(("Tanh", "MatMul")) for name in copies), copies[:10]
    assert not _recompute_ops(theirs, x)


def test_gradients_called_directly_in_tf_function_is_not_autograph_converted(weights, x):
    """Bug found: autograph converted gradients() when a tf.function called it and broke it."""
    @tf.function
    def ours():
        return msg.gradients(_forward(weights, x), weights, checkpoints="memory")

    @tf.function
    def theirs():
        return tf.gradients(_forward(weights, x), weights)

    for a, b in zip(ours(), theirs()):
        _close(a, b)


def test_output_gradients_unconnected_and_unwatched_sources(weights, x):
    other = tf.Variable(tf.ones([32]), name="unused")

    @tf.function
    def both(x, tape_class):
        results = []
        for cls in (msg.GradientTape, tf.GradientTape):
            kwargs = {"checkpoints": "memory"} if cls is msg.GradientTape else {}
            with cls(watch_accessed_variables=False, **kwargs) as tape:
                tape.watch(weights[2:])
                h = tf.tanh(tf.matmul(x, weights[0]))
                for w in weights[1:]:
                    h = tf.tanh(tf.matmul(h, w))
            results.append(tape.gradient(
                h, [weights[0], weights[3], other, x],
                output_gradients=tf.ones_like(h) * 0.5,
                unconnected_gradients=tape_class,
            ))
        return results

    for mode in ("none", "zero"):
        ours, theirs = both(x, tf.UnconnectedGradients(mode))
        assert [g is None for g in ours] == [g is None for g in theirs]
        if mode == "none":
            # w0 and x are not watched, `other` is unused: only w3 has a gradient.
            assert [g is None for g in ours] == [True, False, True, True]
        for a, b in zip(ours, theirs):
            if a is not None:
                _close(a, b)


def test_ops_outside_the_tape_are_not_differentiated_through(weights, x):
    @tf.function
    def both():
        out = []
        for cls in (msg.GradientTape, tf.GradientTape):
            before = tf.tanh(tf.matmul(x, weights[0]))  # made before the tape: a constant
            kwargs = {"checkpoints": "memory"} if cls is msg.GradientTape else {}
            with cls(**kwargs) as tape:
                h = tf.tanh(tf.matmul(before, weights[1]))
                with tape.stop_recording():
                    skipped = tf.matmul(h, weights[2])  # not recorded either
                for w in weights[3:]:
                    h = tf.tanh(tf.matmul(h + 0.1 * skipped, w))
                loss = tf.reduce_sum(h)
            out.append(tape.gradient(loss, weights))
        return out

    ours, theirs = both()
    assert [g is None for g in ours] == [g is None for g in theirs]
    assert ours[0] is None  # only read before the tape started
    for a, b in zip(ours, theirs):
        if a is not None:
            _close(a, b)


def test_persistent_tape_gives_two_gradients(weights, x):
    @tf.function
    def grads():
        with msg.GradientTape(checkpoints="memory", persistent=True) as tape:
            loss = _forward(weights, x)
            loss2 = 3.0 * loss
        return tape.gradient(loss, weights[0]), tape.gradient(loss2, weights[0])

    g1, g2 = grads()
    _close(3.0 * g1.numpy(), g2)


def test_non_persistent_tape_refuses_a_second_gradient(weights, x):
    @tf.function
    def twice():
        with msg.GradientTape(checkpoints="memory") as tape:
            loss = _forward(weights, x)
        tape.gradient(loss, weights)
        return tape.gradient(loss, weights)

    with pytest.raises(RuntimeError, match="non-persistent"):
        twice()


def test_eager_mode_gives_plain_gradients_and_warns_once(weights, x):
    tape_lib._eager_warned.clear()
    with pytest.warns(msg.EagerExecutionWarning) as caught:
        for _ in range(2):
            with msg.GradientTape(checkpoints="memory") as tape:
                loss = _forward(weights, x)
            got = tape.gradient(loss, weights)
    with tf.GradientTape() as tape:
        loss = _forward(weights, x)
    want = tape.gradient(loss, weights)
    for a, b in zip(got, want):
        _close(a, b)
    messages = [w for w in caught if w.category is msg.EagerExecutionWarning]
    assert len(messages) == 1 and "eager" in str(messages[0].message)


@pytest.mark.keras
def test_keras_variables_as_sources():
    keras = pytest.importorskip("keras")
    layer = keras.layers.Dense(16, activation="tanh")
    layer2 = keras.layers.Dense(1)
    inputs = tf.random.stateless_normal([8, 4], seed=[1, 1])
    layer2(layer(inputs))

    @tf.function
    def both():
        out = []
        for cls in (msg.GradientTape, tf.GradientTape):
            kwargs = {"checkpoints": "memory"} if cls is msg.GradientTape else {}
            with cls(**kwargs) as tape:
                loss = tf.reduce_sum(tf.square(layer2(layer(inputs))))
            out.append(tape.gradient(loss, layer.trainable_weights + layer2.trainable_weights))
        return out

    ours, theirs = both()
    assert all(g is not None for g in ours)
    for a, b in zip(ours, theirs):
        _close(a, b)


@pytest.mark.slow
@pytest.mark.memory
def test_tape_in_tf_function_lowers_the_measured_peak(graph, measure_peak):
    """A tf.function training step called in a v1 graph: its nodes show in the step stats.

    24 tanh layers, batch 1024, width 256 (1 MiB per activation).  Also covers
    a core fix: variables of a v1 graph used as xs inside a tf.function.
    """
    rng = np.random.default_rng(0)
    ws = [tf.Variable((rng.standard_normal((256, 256)) / 16.0).astype(np.float32))
          for _ in range(24)]
    x = tf.compat.v1.placeholder(tf.float32, [1024, 256])
    feed = {x: rng.standard_normal((1024, 256)).astype(np.float32)}

    def step_with(tape_class, **kwargs):
        @tf.function
        def step(x):
            with tape_class(**kwargs) as tape:
                h = x
                for w in ws:
                    h = tf.tanh(tf.matmul(h, w))
                loss = tf.reduce_sum(h * h)
            for w, g in zip(ws, tape.gradient(loss, ws)):
                w.assign_sub(0.01 * g)  # stateful: runs although not returned
            return loss
        return step(x)

    plain, _ = measure_peak(step_with(tf.GradientTape), feed)
    ours, _ = measure_peak(step_with(msg.GradientTape, checkpoints="memory"), feed)
    print(f"tf.function step peak: tf.GradientTape {plain / 2**20:.1f} MiB, "
          f"memory_saving_gradients.GradientTape {ours / 2**20:.1f} MiB")
    assert ours < 0.6 * plain, (ours, plain)


def test_a_loss_computed_after_the_with_block_is_said_to_rewrite_nothing():
    """memory_saving_gradients.GradientTape whose target nothing recorded made (the loss
    computed after the with block) gives the tape's own answer, None, as before; it said
    so only at DEBUG, where a patch warns when undone."""
    weights = [tf.Variable(tf.ones([64]) * 0.5) for _ in range(3)]

    @tf.function
    def step(x):
        with msg.GradientTape(checkpoints="memory") as tape:
            h = x
            for w in weights:
                h = tf.tanh(h * w)
        loss = tf.reduce_sum(h * h)
        return tape.gradient(loss, weights)

    with pytest.warns(msg.NothingRewrittenWarning, match="computed after its with block"):
        grads = step(tf.ones([8, 64]))
    assert all(g is None for g in grads)

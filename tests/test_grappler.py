"""Rewritten graphs stay optimizable by grappler.

Grappler optimizes a graph as a whole: when one of its rewrites fails, the
session logs it and runs the whole graph unoptimized (no constant folding, no
pruning of unused copies, no fusions).  In TF 2.21 this happens when a
``Pow(x, 3)`` op has control inputs: its rewrite into ``Square(x) * x`` drops
the wrong input.  The recomputed copies therefore read their inputs through
proxies that carry the control inputs.  These tests run rewritten graphs in a
session and check, from the executed ops, that grappler's rewrites applied.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
import test_models
from memory_saving_gradients import _tensorflow as shim
from memory_saving_gradients import profiling


def _executed_types(fetches, feed) -> collections.Counter:
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        _, metadata = profiling.traced_run(session, fetches, feed)
    return profiling.executed_op_types(metadata)


def _gelu_mlp(layers=6):
    x = tf.compat.v1.placeholder(tf.float32, [16, 64])
    w = tf.Variable(np.random.RandomState(0).randn(64, 64).astype(np.float32) * 0.1)
    h, matmuls = x, []
    for _ in range(layers):
        h = tf.matmul(h, w)
        matmuls.append(h)
        h = 0.5 * h * (1 + tf.tanh(0.79 * (h + 0.044 * tf.pow(h, 3))))
    return tf.reduce_sum(h), w, {x: np.ones([16, 64], np.float32)}, matmuls


@pytest.mark.parametrize("checkpoints", ["one matmul", "speed", "memory"])
def test_cube_rewrite_applies_with_recomputed_copies(graph, checkpoints):
    loss, w, feed, matmuls = _gelu_mlp()
    chosen = [matmuls[2]] if checkpoints == "one matmul" else checkpoints
    grads = msg.gradients(loss, [w], checkpoints=chosen)
    assert any(op.name.startswith("gradients/recompute") for op in graph.get_operations())
    ran = _executed_types(grads, feed)
    # Every Pow(x, 3), forward and recomputed, became Square(x) * x, and each
    # gradient's Pow(x, 3 - 1) a Square once 3 - 1 was folded.
    assert ran["Pow"] == 0 and ran["Square"] > 0


def test_transformer_rewrite_runs_optimized(graph):
    model = test_models.build("transformer", layers=2, d_model=16, heads=2, seq_len=8,
                              batch=2, vocab=32)
    grads = msg.gradients(model.loss, model.params, checkpoints="memory")
    assert _executed_types(grads, model.feed_dict)["Pow"] == 0


def _siamese_convs(x1, x2, filters, biases):
    """Two towers sharing conv + bias + relu layers, whose gradients nearly cancel; the
    loss and each tower's first layer's output."""
    firsts = []

    def tower(h):
        for f, b in zip(filters, biases):
            h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, f, 1, "SAME"), b))
            firsts.append(h)
        return tf.reduce_mean(h, [1, 2])

    loss = tf.reduce_sum(tf.abs(tower(x1) - tower(x2)))
    return loss, firsts[::len(filters)]


@pytest.mark.skipif(not shim.onednn_enabled(), reason="oneDNN's fusion only")
def test_a_recomputed_bias_add_keeps_onednn_s_filter_and_bias_gradient_fusion(graph):
    """A bias add's gradient hands its incoming gradient on and adds a ``BiasAddGrad``.
    That incoming gradient was counted as reading a recomputed tensor (its producer,
    a ``ReluGrad``, reads one), so the two were gated: the convolution's filter gradient
    waited for the ``BiasAddGrad``, which split oneDNN's fusion of the two
    (``Conv2DBackpropFilterWithBias``). The bias gradients were then summed by another
    kernel: on these towers, whose gradients nearly cancel, 4e-3 off plain's (plain's
    own error against float64: 2e-4). Now every recomputed layer runs the fused kernel,
    as plain does, and the gradients equal plain's to float32 precision (each tower
    keeps its first layer's output; the other two layers are recomputed)."""
    rng = np.random.RandomState(0)
    x1, x2 = (tf.constant(rng.randn(16, 32, 32, 3).astype(np.float32)) for _ in range(2))
    filters = [tf.Variable((rng.randn(3, 3, cin, 32) * np.sqrt(2 / (9 * cin))).astype(np.float32))
               for cin in (3, 32, 32)]
    biases = [tf.Variable(np.full(32, 0.01, np.float32)) for _ in range(3)]
    loss, firsts = _siamese_convs(x1, x2, filters, biases)
    plain = tf.gradients(loss, filters + biases)
    ours = msg.gradients(loss, filters + biases, checkpoints=firsts)
    assert any("/recompute_" in op.name for op in graph.get_operations())
    plain_ran, ours_ran = _executed_types(plain, {}), _executed_types(ours, {})
    assert ours_ran["BiasAddGrad"] == 0, ours_ran
    assert ours_ran["Conv2DBackpropFilterWithBias"] == plain_ran["Conv2DBackpropFilterWithBias"]
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        want, got = session.run([plain, ours])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_a_gradient_nothing_reads_is_pruned_as_in_plain(graph):
    """Sixteen weights each read twice: each gradient is a sum of two parts. Fetching one
    of them, grappler prunes the sums nothing reads (and the products only they read),
    as in plain ``tf.gradients``. When every sum the rewrite built was marked to stay as
    built, 17 weight-gradient products ran where the fetched gradient needs 2; now only
    the parts that are sums are marked."""
    weights = [tf.compat.v1.get_variable(f"w{i}", [64, 64]) for i in range(16)]
    h = tf.random.stateless_normal([256, 64], seed=[5, 6])
    for _ in range(2):
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
    grads = msg.gradients(tf.reduce_sum(h * h), weights, checkpoints="memory")
    assert all(g.op.type == "AddN" for g in grads)
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        _, metadata = profiling.traced_run(session, grads[-1])
    ran = {node.node_name for device in metadata.step_stats.dev_stats
           for node in device.node_stats}
    # the weight-gradient products that ran: those of the fetched weight's two reads
    products = [name for name in ran if name in {t.op.name for g in grads for t in g.op.inputs}]
    assert len(products) == 2, sorted(products)


def test_sibling_gradients_of_two_segments_are_not_fused_into_a_cycle():
    """A convolution output kept as a checkpoint, its bias add in the next segment:
    oneDNN's remapper fuses the bias add's BiasAddGrad (one segment) with the
    convolution's Conv2DBackpropFilter (the other), both reading the same
    gradient.  If the second segment's recomputation waited for the BiasAddGrad,
    the fused op would wait for itself ("N nodes in a cycle"); found with
    tf_keras Conv2D + BatchNormalization on a tf.data pipeline."""
    rng = np.random.RandomState(0)
    filters = [tf.Variable(rng.randn(3, 3, 8, 8).astype(np.float32) * 0.2) for _ in range(6)]
    biases = [tf.Variable(np.zeros(8, np.float32)) for _ in range(6)]

    @tf.function(input_signature=[tf.TensorSpec([None, 16, 16, 8])])
    def step(x):
        with tf.GradientTape():
            h, convs = x, []
            for f, b in zip(filters, biases):
                c = tf.nn.conv2d(h, f, 1, "SAME")
                convs.append(c)
                h = tf.nn.relu(tf.nn.bias_add(c, b))
            loss = tf.reduce_sum(h * h)
        grads = msg.gradients(loss, filters + biases, checkpoints=convs[1::2])
        return loss, grads

    graph = step.get_concrete_function().graph
    assert any("recompute" in op.name for op in graph.get_operations())
    x = tf.constant(rng.randn(4, 16, 16, 8).astype(np.float32))
    _, grads = step(x)  # raised InvalidArgumentError "... nodes in a cycle" before

    @tf.function
    def plain(x):
        with tf.GradientTape() as tape:
            h = x
            for f, b in zip(filters, biases):
                h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, f, 1, "SAME"), b))
            loss = tf.reduce_sum(h * h)
        return tape.gradient(loss, filters + biases)

    for a, b in zip(grads, plain(x)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4)


def test_a_wait_that_grappler_moves_onto_a_fused_sibling_closes_no_cycle():
    """As above, with the bias read through two reshapes (as a Keras 3 ``Conv2D``
    does) and every convolution kept.  Two waits that grappler moves closed cycles:
    the next recomputation waited for the reshapes of the bias gradient, which
    grappler removed, so the wait landed on the ``BiasAddGrad`` that oneDNN fuses
    with the next segment's ``Conv2DBackpropFilter`` (found with
    keras.applications.ResNet50 and 'speed'); and with the loss not fetched, the
    top segment's wait on it landed on the last convolution, which oneDNN merged
    with its only reader, the top segment's bias add, whose bias proxy waited for
    it (docs/how-it-works.md step 4)."""
    rng = np.random.RandomState(1)
    filters = [tf.Variable(rng.randn(3, 3, 8, 8).astype(np.float32) * 0.2) for _ in range(6)]
    biases = [tf.Variable(rng.randn(8).astype(np.float32) * 0.1) for _ in range(6)]

    def forward(x, convs=None):
        h = x
        for f, b in zip(filters, biases):
            c = tf.nn.conv2d(h, f, 1, "SAME")
            if convs is not None:
                convs.append(c)
            h = tf.nn.relu(tf.nn.bias_add(c, tf.reshape(tf.reshape(b, [1, 8]), [8])))
        return tf.reduce_sum(h * h)

    @tf.function
    def step(x):
        convs = []
        loss = forward(x, convs)
        return msg.gradients(loss, filters + biases, checkpoints=convs)

    @tf.function
    def plain(x):
        return tf.gradients(forward(x), filters + biases)

    x = tf.constant(rng.randn(4, 16, 16, 8).astype(np.float32))
    for a, b in zip(step(x), plain(x)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4)

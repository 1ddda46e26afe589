"""The memory model's inputs, without a session: what it counts that the region reads
from outside it (:attr:`graph.ForwardRegion.computed_outside`) and how large a
gather's params gradient is (``simulate._gradient_size``)."""

from __future__ import annotations

import pytest
import tensorflow as tf

from memory_saving_gradients import graph as graph_lib
from memory_saving_gradients import simulate

pytestmark = pytest.mark.unit


def _names(pairs):
    return {(t.op.name, buffer.op.name) for t, buffer in pairs}


def test_computed_outside_holds_what_the_step_makes_and_nothing_it_is_given(graph):
    """Of what the region reads from outside it, a mask made from a variable seed counts
    (and a reshape of it counts as the mask's buffer); the fed input, a constant, a
    constant expression grappler folds and a variable's value do not."""
    x = tf.compat.v1.placeholder(tf.float32, [8, 16], name="x")
    w = tf.Variable(tf.ones([16, 16]), name="w")
    seed = tf.Variable([1, 2], dtype=tf.int64, name="seed")
    scale = tf.Variable(2.0, name="scale")
    mask = tf.greater_equal(
        tf.random.stateless_uniform([8, 16], seed=seed), 0.5, name="mask")
    flat_mask = tf.reshape(mask, [128], name="flat_mask")
    folded = tf.multiply(tf.ones([8, 16]), 3.0, name="folded")
    h = tf.matmul(x, w) * folded
    h = tf.where(mask, h, tf.zeros_like(h))
    h = tf.reshape(h, [128])
    h = tf.where(flat_mask, h, tf.zeros_like(h)) * scale
    loss = tf.reduce_sum(h)
    region = graph_lib.forward_region([loss], [w.handle])
    assert _names(region.computed_outside) == {("mask", "mask"), ("flat_mask", "mask")}


def test_computed_outside_walks_deep_ancestries_and_v1_loops(graph):
    """The constant-folding walk up what the region reads keeps its own stack: 3000 ops
    before the region and a v1 while loop's cycle raise nothing (they raised
    ``RecursionError``), and neither folds."""
    tf.compat.v1.disable_control_flow_v2()
    try:
        x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
        early = x
        for _ in range(3000):
            early = tf.tanh(early)
        looped = tf.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0),
                               [tf.constant(0), early])[1]
        w = tf.Variable(tf.ones([4]), name="w")
        loss = tf.reduce_sum(w * early + w * looped)
        region = graph_lib.forward_region([loss], [w.handle])
        found = {t.ref() for t, _ in region.computed_outside}
    finally:
        tf.compat.v1.enable_control_flow_v2()
    assert found == {early.ref(), looped.ref()}


@pytest.mark.parametrize("axis, sparse", [(0, True), (1, False)])
def test_a_gathers_params_gradient_is_the_size_of_its_rows(graph, axis, sparse):
    """Gathering rows (axis 0) makes the params' gradient an ``IndexedSlices``: the
    gathered rows and their indices, not the whole table; along another axis it is dense."""
    table = tf.Variable(tf.ones([1000, 64]), name="table")
    ids = tf.compat.v1.placeholder(tf.int32, [32], name="ids")
    params = table.read_value() if axis else tf.identity(table)
    gathered = tf.gather(params, ids, axis=axis)
    size = graph_lib.tensor_bytes
    got = simulate._gradient_size(params, gathered.op, size)
    want = size(gathered) + size(ids) if sparse else size(params)
    assert got == want

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


def test_plans_are_not_shared_by_regions_fed_differently():
    """Two steps alike from their first weight on, one under an STFT front end and one
    fed the spectrogram, both reading it through an identity: their regions match op
    for op, but the first computes its input in the step (counted) and the second is
    fed it.  A plan is remembered by the region's structure, and the second step traced
    got the first's figures, in either order (a helper's trial: a Conv1D model planned
    at 4.8 MB, its own figure 28).  The key now holds what the model makes of the
    region's inputs: each step's figures are its own, and a retrace still shares."""
    import memory_saving_gradients as msg
    from memory_saving_gradients import memo

    ws = [tf.Variable(tf.random.normal([129, 129], stddev=0.1)) for _ in range(6)]
    plans: list = []

    def loss_of(spectrum):
        h = tf.identity(spectrum)
        for w in ws:
            h = tf.tanh(tf.einsum("btf,fg->btg", h, w))
        loss = tf.reduce_sum(h * h)
        plans.append(msg.plan(loss, ws, checkpoints="memory"))
        return loss

    def computed(x):
        return loss_of(tf.abs(tf.signal.stft(x, frame_length=256, frame_step=64,
                                             fft_length=256)))

    def figures(function, spec):
        tf.function(function, input_signature=[spec]).get_concrete_function()
        made = plans.pop()
        return made.baseline_peak_bytes, made.predicted_peak_bytes

    signal, spectrum = tf.TensorSpec([None, 16000]), tf.TensorSpec([None, 247, 129])
    memo.forget()
    computed_first = figures(computed, signal)
    fed_second = figures(loss_of, spectrum)
    assert figures(loss_of, spectrum) == fed_second  # a retrace
    memo.forget()
    fed_first = figures(loss_of, spectrum)
    computed_second = figures(computed, signal)
    memo.forget()
    assert (fed_second, computed_second) == (fed_first, computed_first)
    assert computed_first[0] > fed_first[0]  # the spectrum, made in the step, counts


def test_the_ops_a_gradient_reaches(graph):
    """``ForwardRegion.receives_gradient``: the ops whose gradient ``tf.gradients``
    builds.  Not those only behind a ``StopGradient`` (an auxiliary figure added to the
    loss) or an ``ArgMin`` (the distances a vector quantizer picks from), nor those inside
    a ``tf.custom_gradient`` function; its arguments' producers are.  The copies of a
    segment that run leave the others out: no gradient reads them."""
    from memory_saving_gradients import graph as graph_lib

    x = tf.compat.v1.placeholder(tf.float32, [8, 16])
    w = tf.Variable(tf.ones([16, 16]))
    codes = tf.Variable(tf.ones([4, 16]))

    @tf.custom_gradient
    def scaled(v):
        inner = tf.tanh(v, name="inner")
        return inner, lambda dy: dy * (1 - inner * inner)

    h = tf.matmul(x, w, name="h")
    side = tf.tanh(h @ w, name="side")
    distances = tf.reduce_sum(tf.square(h[:, None, :] - codes), -1, name="distances")
    picked = tf.gather(codes, tf.argmin(distances, -1), name="picked")
    out = scaled(h + picked)
    loss = tf.reduce_sum(out) + tf.stop_gradient(tf.reduce_mean(side))
    region = graph_lib.forward_region([loss], [w.handle, codes.handle])
    gets = {op.name: region.receives_gradient(op) for op in region.order}
    assert gets["h"] and gets["picked"] and gets["add"], gets
    assert not gets["side"] and not gets["distances"] and not gets["inner"], gets
    assert all(op in region for op in (side.op, distances.op))  # still in the region
    segment = [side.op.inputs[0].op, side.op, distances.op]
    assert graph_lib.copies_that_run(segment) == {side.op, side.op.inputs[0].op}
    assert graph_lib.copies_that_run(segment, receives_gradient=region.receives_gradient) \
        == set()


def test_a_hand_written_override_passes_the_gradient_on(graph):
    """An ``IdentityN`` under a hand-written ``gradient_override_map`` (a straight-through
    estimator) is not a ``tf.custom_gradient`` function: the ops above it receive a
    gradient.  Taken for one with no arguments, none did (a reviewer's check: plain
    predicted 6 MB against 11 measured)."""
    from test_tf_internals import _STRAIGHT_THROUGH

    from memory_saving_gradients import graph as graph_lib

    x = tf.compat.v1.placeholder(tf.float32, [8, 16])
    w = tf.Variable(tf.ones([16, 16]))
    h = tf.tanh(x @ w, name="below")
    with graph.gradient_override_map({"IdentityN": _STRAIGHT_THROUGH}):
        (h,) = tf.identity_n([h * 2.0])
    loss = tf.reduce_sum(tf.tanh(h @ w))
    region = graph_lib.forward_region([loss], [w.handle])
    assert all(region.receives_gradient(op) for op in region.order), [
        op.name for op in region.order if not region.receives_gradient(op)]
    assert graph_lib.custom_gradient_arguments(h.op) is None

"""Monkeypatching: patch()/patched(), the classic assignments, and the v1 optimizers.

``patch()`` must put back exactly the objects that were there, however
patches nest; the v1 optimizers' ``minimize`` must go through the patched
function (recompute copies appear, memory drops) and give the same update.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gradients as tf_ops_gradients
from tensorflow.python.ops import gradients_impl

import memory_saving_gradients as msg
from memory_saving_gradients import patching as patch_lib

# The 'memory' strategy is the headline; until it exists use the collection.
STRATEGY = "memory" if "memory" in msg.available_strategies() else "collection"

SLOTS = (
    (tf, "gradients"),
    (tf.compat.v1, "gradients"),
    (tf.compat.v2, "gradients"),
    (tf_ops_gradients, "gradients"),
)


def _current():
    return [getattr(module, name) for module, name in SLOTS]


def _assert_original():
    assert tf.gradients is gradients_impl.gradients_v2
    assert tf.compat.v1.gradients is gradients_impl.gradients
    assert tf.compat.v2.gradients is gradients_impl.gradients_v2
    assert tf_ops_gradients.gradients is gradients_impl.gradients


@pytest.fixture(autouse=True)
def _restore_tf():
    """Whatever a test does, leave TensorFlow's functions in place after it."""
    before = _current()
    yield
    for (module, name), value in zip(SLOTS, before):
        setattr(module, name, value)
    patch_lib._active.clear()


def _mlp(depth, width, batch, inputs=64, classes=10, seed=0, tanh_after_relu=False):
    """A ReLU MLP in the default graph; returns (loss, feed_dict, activations).

    ``tanh_after_relu``: each layer ends in ReLU then tanh, so that keeping the
    matmuls' outputs ('speed') saves memory (with ReLU alone it keeps as many bytes as
    plain tf.gradients holds, and 'speed' falls back to it)."""
    rng = np.random.default_rng(seed)
    x = tf.compat.v1.placeholder(tf.float32, [batch, inputs], name="x")
    labels = tf.compat.v1.placeholder(tf.int32, [batch], name="labels")
    h, fan_in, activations = x, inputs, []
    for i in range(depth):
        w = tf.Variable((rng.standard_normal((fan_in, width)) * np.sqrt(2.0 / fan_in))
                        .astype(np.float32), name=f"w{i}")
        b = tf.Variable(np.zeros(width, np.float32), name=f"b{i}")
        h = tf.nn.relu(tf.matmul(h, w) + b)
        if tanh_after_relu:
            h = tf.tanh(h)
        activations.append(h)
        fan_in = width
    w = tf.Variable((rng.standard_normal((fan_in, classes)) * 0.05).astype(np.float32),
                    name="w_out")
    logits = tf.matmul(h, w)
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    feed = {x: rng.standard_normal((batch, inputs)).astype(np.float32),
            labels: rng.integers(0, classes, batch).astype(np.int32)}
    if STRATEGY == "collection":
        for t in activations[1::4]:
            tf.compat.v1.add_to_collection("checkpoints", t)
    return loss, feed, activations


def _recompute_ops(graph):
    return [op for op in graph.get_operations() if "recompute" in op.name]


def test_patch_replaces_every_slot_and_undo_restores_the_originals():
    _assert_original()
    handle = msg.patch(STRATEGY)
    replaced = _current()
    assert all(getattr(f, "_memory_saving_gradients", False) for f in replaced)
    assert tf.gradients is tf.compat.v2.gradients is handle.replacements["v2"]
    assert tf.compat.v1.gradients is tf_ops_gradients.gradients is handle.replacements["v1"]
    assert patch_lib.is_patched()
    handle.undo()
    _assert_original()
    handle.undo()  # a second undo changes nothing
    _assert_original()
    assert not patch_lib.is_patched()


@pytest.mark.parametrize("order", ["reverse", "same"])
def test_nested_patches_restore_the_original_in_any_order(order):
    first = msg.patch(STRATEGY)
    second = msg.patch(STRATEGY)
    assert tf.gradients is second.replacements["v2"]
    if order == "reverse":
        second.undo()
        assert tf.gradients is first.replacements["v2"]
        assert tf_ops_gradients.gradients is first.replacements["v1"]
        first.undo()
    else:
        first.undo()  # the later patch stays in force ...
        assert tf.gradients is second.replacements["v2"]
        second.undo()  # ... and hands back the original, not first's function
    _assert_original()


def test_patched_context_manager_restores_after_an_error():
    with pytest.raises(KeyError):
        with msg.patched(STRATEGY) as handle:
            assert tf.compat.v1.gradients is handle.replacements["v1"]
            raise KeyError("boom")
    _assert_original()


def test_a_patch_handle_in_with_blocks_undoes_once_at_the_outermost_and_quietly_on_error():
    """A ``patch()`` handle in nested ``with`` blocks was undone when the inner one
    ended; entered once undone it patched nothing without a word; a block that raised
    warned "rewrote nothing" beside the error (``patched()`` did not)."""
    import warnings

    handle = msg.patch(STRATEGY)
    with handle:
        with handle:
            pass
        assert handle.active and tf.compat.v1.gradients is handle.replacements["v1"]
        with pytest.raises(KeyError), warnings.catch_warnings():
            warnings.simplefilter("error", msg.NothingRewrittenWarning)
            with handle:
                raise KeyError("boom")
    assert not handle.active
    _assert_original()
    with pytest.raises(RuntimeError, match="was undone"):
        with handle:
            pass
    _assert_original()


def test_a_patched_block_can_be_entered_again_and_nested():
    """``patched()`` returned a one-shot generator: entering it again raised an
    AttributeError from contextlib.  Each ``with`` applies a patch of its own."""
    import warnings

    block = msg.patched(STRATEGY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", msg.NothingRewrittenWarning)
        with block as first:
            with block as second:
                assert first is not second and second.active
            assert first.active and not second.active
        assert not first.active
        with block as third:
            assert third.active
    _assert_original()


@pytest.mark.parametrize("bad", [b"memory", {"a": 1}], ids=["bytes", "dict"])
def test_patch_says_what_it_got_for_bytes_or_a_dict(bad):
    """``patch(tape=False)`` listed the bytes' numbers or the dict's keys and named
    the first ("got int 109"); it names what was passed, as gradients() does."""
    with pytest.raises(TypeError, match=type(bad).__name__):
        msg.patch(bad, tape=False)
    _assert_original()


def test_undo_restores_a_user_function_that_was_there_before():
    def mine(*args, **kwargs):
        return gradients_impl.gradients(*args, **kwargs)

    tf.__dict__["gradients"] = mine
    with msg.patched(STRATEGY):
        assert tf.gradients is not mine
    assert tf.gradients is mine


def test_library_never_calls_through_the_patched_names(graph):
    """gradients() uses TensorFlow's function captured at import, not tf.gradients."""
    def trap(*args, **kwargs):
        raise AssertionError("library code called the patched tf.gradients")

    x = tf.constant(np.ones((4, 4), np.float32))
    h1 = tf.tanh(x * 2.0)
    h2 = tf.tanh(h1 * 3.0)
    y = tf.reduce_sum(tf.tanh(h2))
    expected = gradients_impl.gradients(y, [x])
    for module, name in SLOTS:
        setattr(module, name, trap)
    grads = msg.gradients(y, [x], checkpoints=[h1])
    with tf.compat.v1.Session() as sess:
        got, want = sess.run([grads[0], expected[0]])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_patched_tf_gradients_in_tf_function_equals_tensorflow():
    w = tf.Variable(tf.random.stateless_normal([32, 32], seed=[1, 2]) * 0.3)
    x = tf.random.stateless_normal([512, 32], seed=[3, 4])  # activations outweigh w

    def loss_and_checkpoints():
        h, acts = x, []
        for _ in range(8):
            h = tf.tanh(tf.matmul(h, w))
            acts.append(h)
        if STRATEGY == "collection":
            for t in acts[1::3]:
                tf.compat.v1.add_to_collection("checkpoints", t)
        return tf.reduce_sum(h * h)

    @tf.function
    def ours():
        loss = loss_and_checkpoints()
        # TF2 signature, positional up to gate_gradients, and the TF1 keyword.
        (g2,) = tf.gradients(loss, [w], None, "g2", False, colocate_gradients_with_ops=True)
        (g1,) = tf.compat.v1.gradients(loss, [w], None, "g1", True, False)
        return g1, g2

    @tf.function
    def theirs():
        return gradients_impl.gradients(loss_and_checkpoints(), [w])[0]

    with msg.patched(STRATEGY):
        g1, g2 = ours()
        graph = ours.get_concrete_function().graph
    _assert_original()
    expected = theirs().numpy()
    scale = np.abs(expected).max()  # float32 round-off: summation order differs
    np.testing.assert_allclose(g1.numpy(), expected, rtol=1e-4, atol=1e-6 * scale)
    np.testing.assert_allclose(g2.numpy(), expected, rtol=1e-4, atol=1e-6 * scale)
    assert len(_recompute_ops(graph)) > 0


def _minimize_update(graph_maker):
    """Run one minimize step; return (new first-layer weights, recompute op count)."""
    g = tf.Graph()
    with g.as_default():
        loss, feed, _ = _mlp(depth=8, width=32, batch=512)
        train = graph_maker(loss)
        w0 = [v for v in tf.compat.v1.trainable_variables() if v.name.startswith("w0")][0]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train, feed)
            return sess.run(w0), len(_recompute_ops(g))


def test_optimizer_minimize_goes_through_the_patch_and_gives_the_same_update():
    def plain(loss):
        return tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)

    def patched(loss):
        with msg.patched(STRATEGY):
            return tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)

    def momentum(loss):
        with msg.patched(STRATEGY):
            return tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)

    expected, none = _minimize_update(plain)
    got, copies = _minimize_update(patched)
    got_momentum, copies_momentum = _minimize_update(momentum)  # first step = plain SGD
    assert none == 0 and copies > 0 and copies_momentum > 0
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_momentum, expected, rtol=1e-5, atol=1e-6)
    _assert_original()


def test_the_classic_line_reaches_tf_gradients_but_not_an_optimizers_minimize():
    """``tf.__dict__['gradients'] = ...`` replaces the name ``tf.gradients`` only:
    ``minimize`` calls ``tensorflow.python.ops.gradients.gradients``, which
    ``patch()`` replaces too."""
    original = tf.gradients
    g = tf.Graph()
    with g.as_default():
        loss, _, _ = _mlp(depth=8, width=32, batch=512)
        try:
            tf.__dict__["gradients"] = msg.gradients_memory
            tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
            after_minimize = len(_recompute_ops(g))
            tf.gradients(loss, tf.compat.v1.trainable_variables())
            after_tf_gradients = len(_recompute_ops(g))
        finally:
            tf.__dict__["gradients"] = original
        assert after_minimize == 0 and after_tf_gradients > 0
        with msg.patched("memory"):
            tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        assert len(_recompute_ops(g)) > after_tf_gradients


@pytest.mark.parametrize("name", ["gradients_memory", "gradients_speed", "gradients_collection"])
def test_classic_assignments_keep_working(name):
    """``tf.__dict__['gradients'] = ...`` and replacing ops.gradients.gradients."""
    if not hasattr(msg, name):
        pytest.fail(f"memory_saving_gradients.{name} is missing")
    function = getattr(msg, name)
    original_v2, original_ops = tf.gradients, tf_ops_gradients.gradients
    g = tf.Graph()
    with g.as_default():
        loss, feed, acts = _mlp(depth=8, width=32, batch=512, tanh_after_relu=True)
        for t in acts[1::3]:
            tf.compat.v1.add_to_collection("checkpoints", t)
        variables = tf.compat.v1.trainable_variables()
        expected = gradients_impl.gradients(loss, variables)
        try:
            tf.__dict__["gradients"] = function
            ours = tf.gradients(loss, variables)
            tf_ops_gradients.gradients = function
            train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        finally:
            tf.__dict__["gradients"] = original_v2
            tf_ops_gradients.gradients = original_ops
        assert len(_recompute_ops(g)) > 0
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, want = sess.run([ours, expected], feed)
            sess.run(train, feed)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.memory
def test_patched_minimize_peak_is_below_three_quarters_of_plain(measure_peak):
    """24-layer MLP, width 512, batch 256: measured peak of a minimize step."""
    peaks = {}
    for mode in ("plain", "patched"):
        g = tf.Graph()
        with g.as_default():
            loss, feed, _ = _mlp(depth=24, width=512, batch=256)
            optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
            if mode == "patched":
                with msg.patched(STRATEGY):
                    train = optimizer.minimize(loss)
                _assert_original()
                assert len(_recompute_ops(g)) > 0
            else:
                train = optimizer.minimize(loss)
            peaks[mode], _ = measure_peak(train, feed)
    ratio = peaks["patched"] / peaks["plain"]
    print(f"minimize peak: plain {peaks['plain'] / 2**20:.1f} MiB, patched "
          f"{peaks['patched'] / 2**20:.1f} MiB, ratio {ratio:.3f}")
    assert ratio < 0.75, peaks
    assert tf.gradients is gradients_impl.gradients_v2

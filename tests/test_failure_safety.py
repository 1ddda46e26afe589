"""A rewrite that fails midway leaves every op that existed before unchanged.

The failing op is a ``tanh`` whose gradient is mapped (``gradient_override_map``)
to a type with no registered gradient, placed in the middle of a chain, so
that several segments after it are already copied and differentiated when the
error comes.  The error must name the op (the user's op, not a recomputed
copy of it), and every NodeDef of the ops that existed before the call
(inputs, control inputs, attrs, device) must be byte-identical afterwards.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients._tensorflow import tf_gradients

N = 4
DEPTH = 16
BAD = 9  # index of the unit whose gradient is missing


@pytest.fixture(autouse=True)
def _quiet():
    logger = logging.getLogger("memory_saving_gradients")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _snapshot(graph):
    return {op.name: op.node_def.SerializeToString(deterministic=True)
            for op in graph.get_operations()}


def _assert_unchanged(graph, before):
    after = _snapshot(graph)
    changed = [name for name, node_def in before.items() if after.get(name) != node_def]
    assert not changed, f"ops changed by a failed rewrite: {changed[:5]}"


def _chain_with_missing_gradient(graph, bad_type="Tanh", wrap=None):
    x = tf.compat.v1.placeholder(tf.float32, [N], name="x")
    w = tf.Variable(np.linspace(0.5, 1.5, N).astype(np.float32), name="w")
    h = x
    units = []
    for i in range(DEPTH):
        if i == BAD:
            with graph.gradient_override_map({bad_type: "NoSuchGradient"}):
                h = wrap(h) if wrap else tf.tanh(h, name="no_gradient_here")
        else:
            h = tf.tanh(h * w) + 0.1 * h
        units.append(h)
    return x, w, tf.reduce_sum(h), units


VARIANTS = ["every third unit", "every unit"] + msg.available_strategies()


def _checkpoints(variant, units):
    if variant == "every third unit":
        return units[1::3]
    if variant == "every unit":
        return units
    return variant


@pytest.mark.parametrize("variant", VARIANTS)
def test_missing_gradient_midway_changes_nothing_and_names_the_op(variant):
    graph = tf.Graph()
    with graph.as_default():
        x, w, loss, units = _chain_with_missing_gradient(graph)
        with pytest.raises(LookupError) as theirs:
            tf_gradients(loss, [x, w])
        before = _snapshot(graph)
        with pytest.raises(LookupError) as ours:
            msg.gradients(loss, [x, w], checkpoints=_checkpoints(variant, units))
        _assert_unchanged(graph, before)
    assert "'no_gradient_here'" in str(theirs.value)
    assert "'no_gradient_here'" in str(ours.value), str(ours.value)[:300]
    assert "Tanh" in str(ours.value)


def test_a_missing_gradient_adds_only_what_tf_gradients_adds_and_plan_says_so():
    """The op without a gradient is found before anything is built: gradients() raises
    tf.gradients' own LookupError, adding the ops tf.gradients adds (it built about 200
    more first, a helper's trial), and plan() raises naming the op (it returned a plan
    of a backward pass that cannot be built)."""
    counts = {}
    for who in ("tf.gradients", "gradients"):
        graph = tf.Graph()
        with graph.as_default():
            x, w, loss, units = _chain_with_missing_gradient(graph)
            before = len(graph.get_operations())
            with pytest.raises(LookupError, match="no_gradient_here"):
                if who == "gradients":
                    msg.gradients(loss, [x, w], checkpoints=units[1::3])
                else:
                    tf_gradients(loss, [x, w])
            counts[who] = len(graph.get_operations()) - before
            if who == "gradients":
                with pytest.raises(LookupError, match="'no_gradient_here'.*tf.stop_gradient"):
                    msg.plan(loss, [x, w], checkpoints="memory")
                assert len(graph.get_operations()) - before == counts[who]
    assert counts["gradients"] == counts["tf.gradients"], counts


def test_an_op_without_a_gradient_that_no_gradient_reaches_is_no_obstacle():
    """An op with no registered gradient whose output reaches the loss only through
    ``tf.stop_gradient`` (an area resize) is never looked up by tf.gradients; the check
    for missing gradients flagged it and gradients() fell back (plan() raised)."""
    import warnings

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8, 8, 3], name="x")
        w = tf.Variable(tf.ones([3, 3, 3, 3]) * 0.1)
        h, units = x, []
        for _ in range(6):
            h = tf.tanh(tf.nn.conv2d(h, w, 1, "SAME"))
            units.append(h)
        side = tf.stop_gradient(tf.image.resize(h, [4, 4], method="area"))
        loss = tf.reduce_sum(h * h) + tf.reduce_sum(side)
        assert msg.plan(loss, [w], checkpoints=units[1::2]).recomputed_ops
        with warnings.catch_warnings():
            warnings.simplefilter("error", msg.FallbackWarning)
            ours = msg.gradients(loss, [w], checkpoints=units[1::2])
        assert any("recompute" in op.name for op in graph.get_operations())
        theirs = tf_gradients(loss, [w])
        feed = {x: np.linspace(-1, 1, 4 * 8 * 8 * 3).reshape(4, 8, 8, 3).astype(np.float32)}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b = sess.run([ours[0], theirs[0]], feed)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_missing_gradient_of_an_op_differentiated_in_place():
    """An op whose gradient reads nothing (Identity) between two kept tensors is
    differentiated in place, by its gradient function alone."""
    graph = tf.Graph()
    with graph.as_default():
        x, w, loss, units = _chain_with_missing_gradient(
            graph, "Identity", wrap=lambda h: tf.identity(h, name="no_gradient_here"))
        with pytest.raises(LookupError):
            tf_gradients(loss, [x, w])
        before = _snapshot(graph)
        with pytest.raises(LookupError) as ours:
            msg.gradients(loss, [x, w], checkpoints=units)
        _assert_unchanged(graph, before)
    assert "'no_gradient_here'" in str(ours.value)


def test_graph_still_usable_after_a_failed_rewrite():
    """After the failure the forward pass still runs, and a rewrite that avoids the
    bad op (xs after it) still matches tf.gradients."""
    graph = tf.Graph()
    with graph.as_default():
        x, w, loss, units = _chain_with_missing_gradient(graph)
        with pytest.raises(LookupError):
            msg.gradients(loss, [x, w], checkpoints=units[1::3])
        after_bad = units[BAD + 1]
        ours = msg.gradients(loss, [after_bad], checkpoints=units[BAD + 3::2])
        theirs = tf_gradients(loss, [after_bad])
        feed = {x: np.linspace(-1, 1, N).astype(np.float32)}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            value, a, b = sess.run([loss, ours[0], theirs[0]], feed)
    assert np.isfinite(value)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

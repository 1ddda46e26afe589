"""The guard: a rewrite that goes wrong falls back to tf.gradients, and says so.

Faults are injected into the rewrite (a gradient that does not reach one
kept tensor, a sparse gradient made dense, an internal error midway); each
call must return tf.gradients' own gradients (None pattern, kind, values),
give exactly one ``FallbackWarning`` naming the op type and the tensor, log it
at WARNING, and leave every op that existed before the call unchanged.
Without a fault, no warning: the rewrite's gradients are returned.
"""

from __future__ import annotations

import logging
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf
from gradient_values import kind

import memory_saving_gradients as msg
from memory_saving_gradients import checkpointing, rewrite
from memory_saving_gradients._tensorflow import tf_gradients
from memory_saving_gradients.notices import FallbackWarning, MemorySavingGradientsWarning

N = 6


def _embedding_chain(graph):
    """ids -> gather(table) -> 6 x tanh(matmul(., w_i)) -> loss; the table's gradient
    is an IndexedSlices, the weights' dense."""
    rng = np.random.RandomState(0)
    table = tf.Variable(rng.randn(12, N).astype(np.float32), name="table")
    weights = [tf.Variable(rng.randn(N, N).astype(np.float32) * 0.4, name=f"w{i}")
               for i in range(6)]
    ids = tf.constant([1, 3, 3, 7], name="ids")
    h = tf.gather(table, ids)
    units = []
    for w in weights:
        h = tf.tanh(tf.matmul(h, w))
        units.append(h)
    return tf.reduce_sum(h * h), [table] + weights, units


def _snapshot(graph):
    return {op.name: op.node_def.SerializeToString(deterministic=True)
            for op in graph.get_operations()}


def _call(loss, xs, checkpoints, caplog):
    graph = loss.graph
    before = _snapshot(graph)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(
            logging.WARNING, logger="memory_saving_gradients"):
        warnings.simplefilter("always")
        ours = msg.gradients(loss, xs, checkpoints=checkpoints)
    after = _snapshot(graph)
    changed = [name for name, node_def in before.items() if after.get(name) != node_def]
    assert not changed, f"pre-existing ops changed: {changed[:5]}"
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    logged = [r for r in caplog.records if "plain tf.gradients instead" in r.getMessage()]
    return ours, [str(w.message) for w in fallbacks], logged


def _assert_equal_to_tf(loss, xs, ours):
    theirs = tf_gradients(loss, xs)
    assert [kind(g) for g in ours] == [kind(g) for g in theirs]
    with tf.compat.v1.Session(graph=loss.graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        a, b = sess.run([[tf.convert_to_tensor(g) for g in ours],
                         [tf.convert_to_tensor(g) for g in theirs]])
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


def test_no_fault_no_warning(graph, caplog):
    loss, xs, units = _embedding_chain(graph)
    for checkpoints in (units[1::2], "memory", "speed"):
        ours, fallbacks, logged = _call(loss, xs, checkpoints, caplog)
        assert not fallbacks and not logged, fallbacks
        assert kind(ours[0]) == "sparse"
    _assert_equal_to_tf(loss, xs, ours)


def test_a_gradient_lost_midway_falls_back_and_names_the_op(graph, caplog, monkeypatch):
    """One kept tensor (a unit's output) is left out of the tensors the rewrite passes
    gradients to: every x before it would get None."""
    loss, xs, units = _embedding_chain(graph)
    lost = units[2]
    carriers = checkpointing.graph_lib.gradient_carriers

    def losing(*args, **kwargs):
        return frozenset(r for r in carriers(*args, **kwargs) if r != lost.ref())

    monkeypatch.setattr(checkpointing.graph_lib, "gradient_carriers", losing)
    ours, fallbacks, logged = _call(loss, xs, units[::2], caplog)
    assert len(fallbacks) == 1 and len(logged) == 1, fallbacks
    # the library's name once, in the warning and in the log line (the log had it twice)
    for said in (fallbacks[0], logged[0].getMessage()):
        assert said.startswith("memory_saving_gradients: ") and said.count(
            "memory_saving_gradients:") == 1, said
    message = fallbacks[0]
    # the first x that lost its gradient, and the op where the backward pass first differs
    assert "no gradient for table" in message and "tf.gradients gives an IndexedSlices" in message
    assert f"'{lost.op.name}' (type Tanh)" in message, message
    _assert_equal_to_tf(loss, xs, ours)


def test_a_sparse_gradient_made_dense_falls_back(graph, caplog, monkeypatch):
    """The rewrite's sum makes the table's IndexedSlices dense: the structure differs."""
    loss, xs, units = _embedding_chain(graph)
    real_sum = rewrite.sum_gradients

    def densifying(grads, *args, **kwargs):
        return tf.convert_to_tensor(real_sum(grads, *args, **kwargs))

    monkeypatch.setattr(rewrite, "sum_gradients", densifying)
    ours, fallbacks, logged = _call(loss, xs, "memory", caplog)
    assert len(fallbacks) == 1 and len(logged) == 1
    assert "a dense gradient for table" in fallbacks[0], fallbacks[0]
    assert "(type ReadVariableOp)" in fallbacks[0] or "(type ResourceGather)" in fallbacks[0]
    assert kind(ours[0]) == "sparse"
    _assert_equal_to_tf(loss, xs, ours)


def test_an_internal_error_falls_back(graph, caplog, monkeypatch):
    """An error inside the rewrite that tf.gradients does not raise (after some
    segments are built) falls back; the warning names it."""
    loss, xs, units = _embedding_chain(graph)
    real_copy = rewrite.copy_ops
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("injected")
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(rewrite, "copy_ops", failing)
    ours, fallbacks, logged = _call(loss, xs, units[::2], caplog)
    assert len(calls) >= 3
    assert len(fallbacks) == 1 and len(logged) == 1
    assert "KeyError" in fallbacks[0] and "injected" in fallbacks[0]
    _assert_equal_to_tf(loss, xs, ours)


def test_user_errors_still_raise(graph, caplog):
    """What tf.gradients rejects too stays an error (no fallback, no warning)."""
    loss, xs, units = _embedding_chain(graph)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError):
            msg.gradients(loss, xs, grad_ys=[tf.ones([3])], checkpoints=units[::2])
        with pytest.raises(ValueError, match="can be used"):
            msg.gradients(loss, xs, checkpoints=[xs[1].handle])
    assert not [w for w in caught if issubclass(w.category, MemorySavingGradientsWarning)]


def test_tape_falls_back_too(monkeypatch):
    """The tape patch goes through gradients(): a fault there falls back the same way."""
    rng = np.random.RandomState(1)
    ws = [tf.Variable(rng.randn(N, N).astype(np.float32) * 0.4) for _ in range(5)]
    # only the xs carry gradients: what reaches a kept activation is dropped
    monkeypatch.setattr(checkpointing.graph_lib, "gradient_carriers",
                        lambda region, xs, *a: frozenset(x.ref() for x in xs))

    @tf.function
    def step(x):
        with msg.GradientTape(checkpoints="memory") as tape:
            h = x
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_sum(h)
        with tf.GradientTape() as plain:
            h = x
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            plain_loss = tf.reduce_sum(h)
        return tape.gradient(loss, ws), plain.gradient(plain_loss, ws)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, theirs = step(tf.constant(rng.randn(4, N).astype(np.float32)))
    assert len([w for w in caught if issubclass(w.category, FallbackWarning)]) == 1
    for a, b in zip(ours, theirs):
        assert a is not None
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)

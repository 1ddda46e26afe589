"""``plan()`` and ``gradients()`` see one backward schedule.

The memory model replays the steps of :func:`schedule.backward_schedule` and
the rewrite builds them; ``Plan.schedule`` is what the prediction replayed and
``Record.schedules`` what ``gradients()`` built.  They must be the same step for
step (group, handling, segment ops, inputs) on v1 ``while_loop`` and ``cond``
(kept whole, one step each), with ``stop_gradients`` (no step for a stopped op),
and on the benchmark models.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gradient_values import control_flow_v1, unrolled_lstm_states

import memory_saving_gradients as msg
import test_models
from memory_saving_gradients import reporting, schedule

SIZE = 64


def _built_schedule(loss, xs, **options):
    """The schedule ``gradients()`` built, from its record."""
    record = reporting.Record()
    with reporting.recording(record), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msg.gradients(loss, xs, **options)
    assert len(record.schedules) == 1
    return record.schedules[0]


def _assert_same_schedule(loss, xs, checkpoints, stops=None):
    planned = msg.plan(loss, xs, checkpoints=checkpoints, stop_gradients=stops)
    built = _built_schedule(loss, xs, checkpoints=checkpoints, stop_gradients=stops)
    assert planned.schedule is not None
    assert planned.schedule.describe() == built.describe()
    assert planned.schedule.steps, "an empty schedule compares nothing"
    return built


def _tanh_chain(h, n):
    units = []
    for _ in range(n):
        h = tf.tanh(h)
        units.append(h)
    return h, units


def _v1_model(kind):
    x = tf.compat.v1.placeholder(tf.float32, [SIZE], name="x")
    h, before = _tanh_chain(x, 4)
    if kind == "while":
        _, h = tf.compat.v1.while_loop(
            lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(h) * 0.9), [tf.constant(0), h])
    else:
        h = tf.compat.v1.cond(tf.reduce_sum(h) > 0, lambda: tf.tanh(h), lambda: tf.sin(h))
    h, after = _tanh_chain(h, 4)
    return x, tf.reduce_sum(h), before[1::2] + after[1::2]


@pytest.mark.parametrize("kind", ["while", "cond"])
def test_v1_control_flow_is_one_whole_step_in_plan_and_gradients(kind):
    graph = tf.Graph()
    with control_flow_v1(), graph.as_default():
        x, loss, marks = _v1_model(kind)
        built = _assert_same_schedule(loss, x, marks)
        _assert_same_schedule(loss, x, "memory")
    whole = [step for step in built.steps if step.handling == schedule.WHOLE]
    assert len(whole) == 1, built.describe()
    inner = {op.type for op in whole[0].segment.ops}
    assert ({"Enter", "Exit"} if kind == "while" else {"Switch", "Merge"}) <= inner
    # no other step differentiates an op of the construct
    construct = set(whole[0].segment.ops)
    assert not any(set(step.group) & construct for step in built.steps if step is not whole[0])


def test_stop_gradients_change_the_planned_schedule_as_the_built_one():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [SIZE], name="x")
        w = tf.Variable(tf.ones([SIZE]))
        h, units = _tanh_chain(x * w, 8)
        loss = tf.reduce_sum(h)
        marks, stop = units[1::2], units[3]
        built = _assert_same_schedule(loss, [x, w], marks, stops=[stop])
        plain = msg.plan(loss, [x, w], checkpoints=marks).schedule
    stopped = [s for s in plain.steps if stop.op in s.group]
    assert stopped, "without stop_gradients the stopped tensor's op has a step"
    assert not [s for s in built.steps if stop.op in s.group]
    assert built.stop_ops == frozenset({stop.op})


MODELS = {
    "resnet": dict(depth=8, batch=2),
    "transformer": dict(layers=1, batch=2, seq_len=8, d_model=32),
    "unet": dict(levels=2, batch=2),
    "mlp": dict(depth=4, batch=32),
    "chain": dict(n=12, size=256),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("strategy", ["memory", "collection"])
def test_benchmark_models_plan_the_schedule_gradients_builds(name, strategy):
    graph = tf.Graph()
    with graph.as_default():
        model = test_models.build(name, add_to_collection=True, **MODELS[name])
        built = _assert_same_schedule(model.loss, model.params or model.inputs, strategy)
    assert {step.handling for step in built.steps} & {schedule.RECOMPUTED}


@pytest.mark.parametrize("bad", [[1.5], "x", [None]])
def test_plan_rejects_stop_gradients_as_gradients_does(bad):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [SIZE], name="x")
        h, units = _tanh_chain(x, 4)
        loss = tf.reduce_sum(h)
        errors = []
        for call in (msg.plan, msg.gradients):
            with pytest.raises((TypeError, ValueError)) as caught:
                call(loss, x, checkpoints=units[1:2], stop_gradients=bad)
            errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]
    assert "stop_gradients" in errors[0][1]


@pytest.mark.parametrize("empty", [[], ()])
def test_an_empty_stop_gradients_stops_nothing_as_in_tf_gradients(empty):
    """tf.gradients takes ``stop_gradients=[]`` as stopping nothing; so do plan() and
    gradients() (they raised "stop_gradients is empty")."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [SIZE], name="x")
        h, units = _tanh_chain(x, 4)
        loss = tf.reduce_sum(h)
        made = msg.plan(loss, x, checkpoints=units[1:2], stop_gradients=empty)
        assert made.recomputed_ops
        ours = msg.gradients(loss, x, checkpoints=units[1:2], stop_gradients=empty)
        reference = tf.gradients(loss, x, stop_gradients=empty)
        with tf.compat.v1.Session() as session:
            feed = {x: np.linspace(-1.0, 1.0, SIZE, dtype=np.float32)}
            got, want = session.run([ours, reference], feed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_a_plan_that_keeps_nothing_is_plain_tf_gradients():
    """'speed' on a tanh chain keeps nothing, so gradients() calls plain tf.gradients:
    plan() says the same (the baseline's peak, no recomputation, no schedule)."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [64, 256])
        w = tf.Variable(tf.ones([256]))
        h = x * w
        for _ in range(12):
            h = tf.tanh(h)
        loss = tf.reduce_sum(h)
        with pytest.warns(msg.NothingKeptWarning):
            the_plan = msg.plan(loss, [w], checkpoints="speed")
    assert the_plan.checkpoints == () and the_plan.schedule is None
    assert the_plan.predicted_peak_bytes == the_plan.baseline_peak_bytes
    assert the_plan.recompute_cost == 0 and the_plan.predicted_step_ratio == 1.0


def test_in_place_steps_of_variable_reads_add_no_identities():
    """A variable read's in-place step hands its gradient straight to the registered
    gradient: only v1 TensorArray ops need it renamed through an identity (each is a
    node the step runs), and the gradients still equal tf.gradients'."""
    with tf.Graph().as_default() as graph:
        model = test_models.resnet.build(depth=8, batch=2)
        xs = list(model.params)
        the_plan = msg.plan(model.loss, xs, checkpoints="memory")
        in_place = {f"backprop_{s.index}" for s in the_plan.schedule.steps
                    if s.handling == schedule.IN_PLACE}
        assert len(in_place) >= len(xs) // 2, "the check needs in-place variable reads"
        before = set(graph.get_operations())
        ours = msg.gradients(model.loss, xs, checkpoints="memory")
        renamed = [op.name for op in graph.get_operations() if op not in before
                   and op.type == "Identity" and in_place & set(op.name.split("/"))]
        theirs = tf.compat.v1.gradients(model.loss, xs)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            feed = dict(getattr(model, "feed_dict", None) or {})
            got, want = session.run([ours, theirs], feed)
    assert renamed == []
    for a, b in zip(got, want):
        assert abs(a - b).max() <= 1e-4 * (1 + abs(b).max())


def test_gradients_taken_again_where_segments_share_ops_count_in_the_step_time():
    """An unrolled LSTM whose kept tensors cut its ``h`` path but not its ``c`` path:
    the segments of two kept ``h`` share the gates and cell updates before the first.
    Where they cannot be merged (the first ``h`` is also an x, whose own gradient is
    wanted, so the second's segment must read it as an input), each step
    differentiates the shared ops with its part of the gradient. The rewrite builds
    those gradients twice, and the time model counts them (a Keras ``LSTM(unroll=True)``
    stack, before such segments were merged: 1.30x predicted without them, 1.58x with
    them, 1.53-1.57x measured CPU time)."""
    from memory_saving_gradients import graph as graph_lib
    from memory_saving_gradients import simulate

    with tf.Graph().as_default() as graph:
        x = tf.random.normal([4, 6, 8], seed=1)
        kernel = tf.random.normal([8, 32], seed=2) * 0.3  # drawn once per run: both
        recurrent = tf.random.normal([8, 32], seed=3) * 0.3  # gradients see the same
        hs = unrolled_lstm_states(x, kernel, recurrent)
        loss = tf.reduce_sum(hs[-1] * hs[-1])
        # hs[1] is an x too: its own gradient is wanted, so hs[3]'s segment reads it as
        # an input, and the two segments cannot be merged
        weights = [kernel, recurrent, hs[1]]
        kept = [hs[1], hs[3]]
        the_plan = msg.plan(loss, weights, checkpoints=kept)
        times = {}
        for step in the_plan.schedule.steps:
            if step.handling == schedule.RECOMPUTED:
                for op in step.segment.ops:
                    times[op] = times.get(op, 0) + 1
        repeated_sigmoids = sum(n - 1 for op, n in times.items() if op.type == "Sigmoid")
        assert repeated_sigmoids > 0, "no segments share ops: the test would prove nothing"
        before = len(graph.get_operations())
        ours = msg.gradients(loss, weights, checkpoints=kept)
        built = [op for op in graph.get_operations()[before:] if op.type == "SigmoidGrad"]
        assert len(built) == 18 + repeated_sigmoids  # 3 gates x 6 steps, and the repeats
        theirs = tf.gradients(loss, weights)
        with tf.compat.v1.Session() as session:
            for a, b in zip(*session.run([ours, theirs])):
                assert abs(a - b).max() <= 1e-5 * max(1.0, abs(b).max())

        region = graph_lib.forward_region([loss], weights)
        predicted = simulate.predict_checkpointed(region, [loss], weights, kept)
        plain = predicted.forward_seconds + predicted.backward_seconds
        assert predicted.repeated_backward_seconds > 0
        assert predicted.step_time_ratio == pytest.approx(
            (plain + predicted.recompute_seconds + predicted.repeated_backward_seconds) / plain)
        # the plan prices each kernel its replay ran, with the cache term; this graph
        # fits the cache, so its ratio is the same within 1%
        assert the_plan.predicted_step_ratio == pytest.approx(predicted.step_time_ratio, rel=0.01)

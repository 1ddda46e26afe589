"""Control flow in the forward pass: tf.while_loop and tf.cond, v2 and v1 forms.

v2 (``While``/``If`` ops, the default, also in tf.compat.v1 graphs) are single
ops in the differentiated graph; v1 (``Enter``/``Switch``/``Merge``/``Exit``,
after ``tf.compat.v1.disable_control_flow_v2()``) are many ops in
control-flow contexts.  Either way a loop or cond is kept whole and
differentiated whole by TensorFlow, never copied or split; everything around
it is recomputed as usual.  Checkpoints inside a loop or cond body are
ignored.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from gradient_values import control_flow_v1

import memory_saving_gradients as msg
from memory_saving_gradients import profiling

WIDTH = 16
BATCH = 4
V1_TYPES = {"Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
            "NextIteration", "RefNextIteration", "LoopCond"}
V2_TYPES = {"While", "StatelessWhile", "If", "StatelessIf"}
AUTOMATIC = [s for s in msg.available_strategies() if s != "collection"]



def _weights():
    rng = np.random.RandomState(0)
    ws = [rng.standard_normal([WIDTH, WIDTH]).astype(np.float32) * 0.4 for _ in range(5)]
    x = rng.standard_normal([BATCH, WIDTH]).astype(np.float32)
    return x, ws


def model(x, ws, direct=False):
    """tanh layers, a while loop (a cond nested in its body), a cond, tanh layers.

    Returns (loss, marks, inside): marks are tensors before/after the
    constructs, inside are tensors of loop and cond bodies.  With ``direct``
    the constructs follow each other with no op between: cond -> loop -> cond.
    """
    marks, inside = {}, []
    h = tf.tanh(tf.matmul(x, ws[0]))
    marks["pre"] = h
    h = tf.tanh(tf.matmul(h, ws[1]))
    marks["pre2"] = h
    if direct:
        h = tf.cond(tf.reduce_sum(h) > -1e9, lambda: tf.tanh(h) * 1.5, lambda: h)

    def body(i, h):
        a = tf.tanh(tf.matmul(h, ws[2]))
        inside.append(a)
        a = tf.cond(tf.equal(i % 2, 0), lambda: tf.tanh(a), lambda: a * 0.5)
        return i + 1, a

    _, h = tf.while_loop(lambda i, h: i < 3, body, [tf.constant(0), h])
    marks["loop"] = h
    if not direct:
        h = tf.tanh(h)
        marks["post_loop"] = h

    def true_branch():
        t = tf.tanh(tf.matmul(h, ws[3]))
        inside.append(t)
        return t

    h = tf.cond(tf.reduce_sum(h) > -1e9, true_branch, lambda: h * 2.0)
    marks["cond"] = h
    h = tf.tanh(tf.matmul(h, ws[4]))
    marks["post"] = h
    h = tf.tanh(h)
    return tf.reduce_sum(h * h), marks, inside


CHECKPOINT_SETS = {
    "before": lambda m, i: [m["pre"]],
    "after": lambda m, i: [m["post"]] + ([m["post_loop"]] if "post_loop" in m else []),
    "around": lambda m, i: list(m.values()),
    "construct_outputs": lambda m, i: [m["loop"], m["cond"]],
    "plus_inside_loop": lambda m, i: [m["pre2"], i[0], m["post"]],
    "plus_inside_cond": lambda m, i: [i[-1], m["post"]],
}


def _new_ops(graph, before):
    return [op for op in graph.get_operations() if op._id > before]  # pylint: disable=protected-access


def _assert_never_split(new_ops):
    """No copy is a control-flow op or an op of a loop/cond body."""
    copies = [op for op in new_ops if "/recompute_" in op.name]
    assert copies, "nothing was recomputed"
    for op in copies:
        assert op.type not in V1_TYPES | V2_TYPES, op.name
        assert op._control_flow_context is None, op.name  # pylint: disable=protected-access


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


# ------------------------------------------------------------------- v2, tf.function


@pytest.mark.slow
@pytest.mark.parametrize("direct", [False, True])
def test_v2_in_tf_function_list_checkpoints(direct):
    x_value, w_values = _weights()
    results = {}

    @tf.function
    def run(x, ws):
        loss, marks, inside = model(x, ws, direct)
        assert any(op.type in V2_TYPES for op in loss.graph.get_operations())
        reference = tf.compat.v1.gradients(loss, [x] + ws)
        out = {}
        for name, pick in CHECKPOINT_SETS.items():
            if name == "after" and direct:
                continue
            before = max(op._id for op in loss.graph.get_operations())  # pylint: disable=protected-access
            out[name] = msg.gradients(loss, [x] + ws, checkpoints=pick(marks, inside))
            new_ops = _new_ops(loss.graph, before)
            _assert_never_split(new_ops)
            results[name] = new_ops
        return reference, out

    reference, out = run(tf.constant(x_value), [tf.constant(w) for w in w_values])
    assert len(out) >= 5
    for name, grads in out.items():
        assert _max_diff(grads, reference) < 1e-5, name


def test_v2_in_tf_function_checkpoints_only_inside_are_an_error():
    x_value, w_values = _weights()

    @tf.function
    def run(x, ws):
        loss, _, inside = model(x, ws)
        msg.gradients(loss, [x] + ws, checkpoints=inside)

    with pytest.raises(ValueError, match="None of the 2 checkpoints can be used"):
        run(tf.constant(x_value), [tf.constant(w) for w in w_values])


@pytest.mark.parametrize("strategy", AUTOMATIC)
def test_v2_in_tf_function_automatic_strategies(strategy):
    x_value, w_values = _weights()

    @tf.function
    def run(x, ws):
        loss, _, _ = model(x, ws)
        return tf.compat.v1.gradients(loss, [x] + ws), msg.gradients(
            loss, [x] + ws, checkpoints=strategy)

    reference, ours = run(tf.constant(x_value), [tf.constant(w) for w in w_values])
    assert _max_diff(ours, reference) < 1e-5


# ------------------------------------------------------------------- v1 graphs


def _v1_run(direct, checkpoint_sets, strategies=(), use_v1_control_flow=True):
    x_value, w_values = _weights()
    graph = tf.Graph()
    scope = control_flow_v1() if use_v1_control_flow else contextlib.nullcontext()
    with scope, graph.as_default():
        x = tf.constant(x_value)
        ws = [tf.constant(w) for w in w_values]
        loss, marks, inside = model(x, ws, direct)
        types = {op.type for op in graph.get_operations()}
        if use_v1_control_flow:
            assert {"Enter", "Exit", "Switch", "Merge"} <= types and not types & V2_TYPES
        else:
            assert types & V2_TYPES and not types & V1_TYPES
        for t in marks.values():
            graph.add_to_collection("checkpoints", t)
        reference = tf.compat.v1.gradients(loss, [x] + ws)
        out = {}
        for name, pick in checkpoint_sets.items():
            before = max(op._id for op in graph.get_operations())  # pylint: disable=protected-access
            out[name] = msg.gradients(loss, [x] + ws, checkpoints=pick(marks, inside))
            _assert_never_split(_new_ops(graph, before))
        for strategy in strategies:
            out[strategy] = msg.gradients(loss, [x] + ws, checkpoints=strategy)
        with tf.compat.v1.Session(graph=graph) as sess:
            return sess.run((reference, out))


@pytest.mark.parametrize("direct", [False, True])
def test_v1_switch_merge_list_checkpoints(direct):
    sets = {k: v for k, v in CHECKPOINT_SETS.items() if not (direct and k == "after")}
    reference, out = _v1_run(direct, sets)
    for name, grads in out.items():
        assert _max_diff(grads, reference) < 1e-5, name


def test_v1_switch_merge_automatic_strategies():
    reference, out = _v1_run(False, {}, strategies=["collection"] + AUTOMATIC)
    assert set(out) == {"collection", *AUTOMATIC}
    for name, grads in out.items():
        assert _max_diff(grads, reference) < 1e-5, name


def test_v2_ops_in_v1_graph():
    reference, out = _v1_run(
        False, CHECKPOINT_SETS, strategies=AUTOMATIC, use_v1_control_flow=False
    )
    for name, grads in out.items():
        assert _max_diff(grads, reference) < 1e-5, name


def test_v1_control_flow_setting_restored():
    assert tf.compat.v1.control_flow_v2_enabled()


# ------------------------------------------------------------------- memory


CHAIN = 12
SIZE = 65536  # float32 elements: 256 KiB per activation


def _loop_chain(x):
    """CHAIN tanh, a 4-step while loop, CHAIN tanh; checkpoints every 3rd tanh."""
    units = []
    h = x
    for _ in range(CHAIN):
        h = tf.tanh(h)
        units.append(h)
    _, h = tf.while_loop(lambda i, h: i < 4, lambda i, h: (i + 1, tf.tanh(h) * 0.9),
                         [tf.constant(0), h])
    for _ in range(CHAIN):
        h = tf.tanh(h)
        units.append(h)
    return tf.reduce_sum(h), units[2::3]


@pytest.mark.memory
@pytest.mark.parametrize("v1", [False, True], ids=["while_v2", "while_v1"])
def test_recomputation_around_a_loop_saves_memory(v1):
    """Peak of the backward pass with a loop in the middle of two tanh chains."""
    value = np.linspace(-1, 1, SIZE).astype(np.float32)
    peaks, grads = {}, {}
    for mode in ("plain", "ours"):
        graph = tf.Graph()
        with (control_flow_v1() if v1 else contextlib.nullcontext()), graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [SIZE])
            loss, checkpoints = _loop_chain(x)
            if mode == "plain":
                g = tf.compat.v1.gradients(loss, x)
            else:
                g = msg.gradients(loss, x, checkpoints=checkpoints)
            with tf.compat.v1.Session(graph=graph) as sess:
                values, metadata = profiling.traced_run(sess, g, {x: value})
        grads[mode] = values[0]
        peaks[mode] = max(profiling.peak_memory(metadata).values())
    np.testing.assert_allclose(grads["ours"], grads["plain"], rtol=1e-5, atol=1e-6)
    activation = SIZE * 4
    # Plain keeps the 24 chain activations (and the loop's); ours keeps 8
    # checkpoints, the loop's values and a few recomputed activations.
    assert peaks["plain"] >= 2 * CHAIN * activation, peaks
    assert peaks["ours"] <= 0.7 * peaks["plain"], peaks


@pytest.mark.unit
@pytest.mark.parametrize("v1", [False, True], ids=["while_v2", "while_v1"])
def test_a_plan_says_what_it_does_not_count_of_a_v1_loop(v1):
    """A v1 loop keeps its steps' tensors in stacks the memory model does not count: the
    plan says so; a v2 loop's are counted, and no such note is given."""
    with (control_flow_v1() if v1 else contextlib.nullcontext()), tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [SIZE])
        loss, checkpoints = _loop_chain(x)
        notes = " ".join(msg.plan(loss, x, checkpoints=checkpoints).assumptions)
    assert ("v1 control-flow while loop" in notes) == v1, notes

"""Loops that carry and write TensorArrays, and the Keras RNN layers built on them.

A loop hands what it wrote to the rest of the graph through a ``variant``
tensor (a ``TensorList``: a ``TensorArray`` under control flow v2) that a
``TensorListStack`` after the ``While`` reads; v1 control flow uses a
``TensorArrayV3`` resource and a float flow instead.  The loop is kept whole
and differentiated by TensorFlow; the ops after it are recomputed, so the
gradient must flow through the variant into the loop (before, the weights
read inside loops got ``None``), and every segment's TensorArray gradients
must find the same accumulator (before, v1 loops got wrong values).

Every test compares with plain ``tf.gradients`` / a plain tape: the None
pattern, dtypes and values, for every strategy, and checks that something
was recomputed (a comparison with a plain fallback would prove nothing).

CI runs a sample of the construct x mode matrix; ``LOOP_TESTS=full`` runs
all of it (51 tests, 2.7-5.5 minutes on 2 shared cores, against 1.5-2 for CI's 31).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest
import tensorflow as tf
from gradient_values import control_flow_v1

import memory_saving_gradients as msg

try:
    import keras
except ImportError:  # the Keras tests are skipped; the loop tests still run
    keras = None

FULL = os.environ.get("LOOP_TESTS") == "full"
STEPS, BATCH, WIDTH, DEPTH = 8, 16, 32, 8


@pytest.fixture(autouse=True)
def _quiet():
    """Strategies that find nothing to keep warn; these tests assert on recomputation instead."""
    logger = logging.getLogger("memory_saving_gradients")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)



def _values():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, BATCH, WIDTH)).astype(np.float32)
    u = (rng.normal(size=(WIDTH, WIDTH)) * 0.3).astype(np.float32)
    ws = [(rng.normal(size=(WIDTH, WIDTH)) * 0.3).astype(np.float32) for _ in range(DEPTH)]
    return x, u, ws


# ----------------------------------------------------------------- the constructs
# Each takes (x [STEPS, BATCH, WIDTH], u [WIDTH, WIDTH], dense weights, marks) and
# returns a scalar loss; ``marks`` collects tensors outside the loop, from which the
# list and collection strategies pick checkpoints.  Loops have maximum_iterations
# (XLA needs a fixed list size).


def _dense_layers(y, ws, marks):
    for w in ws:  # two tanhs a layer: keeping the matmuls ('speed') then saves memory
        y = tf.tanh(tf.tanh(tf.matmul(tf.reshape(y, [-1, WIDTH]), w)))
        marks.append(y)
    return tf.reduce_sum(y * y)


def _while_writes(x, u, ws, marks):
    """The issue's repro: h = tanh(x[t] + h @ u), h written into a TensorArray, stacked."""
    def body(t, h, out):
        h = tf.tanh(x[t] + h @ u)
        return t + 1, h, out.write(t, h)

    _, _, out = tf.while_loop(
        lambda t, *_: t < STEPS, body, maximum_iterations=STEPS,
        loop_vars=(0, tf.zeros((BATCH, WIDTH)), tf.TensorArray(tf.float32, STEPS)))
    y = out.stack()
    marks.append(y)
    return _dense_layers(y, ws, marks)


def _while_reads_and_writes(x, u, ws, marks):
    """A loop carrying a TensorArray it reads (unstacked from a computed tensor), one it
    writes, and the state; the stack and the last state both feed the rest."""
    pre = tf.tanh(x * 1.5)
    marks.append(pre)
    inputs = tf.TensorArray(tf.float32, STEPS).unstack(pre)

    def body(t, h, out):
        h = tf.tanh(inputs.read(t) + h @ u)
        return t + 1, h, out.write(t, h * 2.0)

    _, h, out = tf.while_loop(
        lambda t, *_: t < STEPS, body, maximum_iterations=STEPS,
        loop_vars=(0, tf.zeros((BATCH, WIDTH)), tf.TensorArray(tf.float32, STEPS)))
    y = out.stack() + h
    marks.append(y)
    return _dense_layers(y, ws, marks)


def _nested_loops(x, u, ws, marks):
    """A loop whose body runs a loop that writes its own TensorArray."""
    def outer(t, h, out):
        def inner(s, g, seen):
            g = tf.tanh(x[t] + g @ u)
            return s + 1, g, seen.write(s, g)

        _, g, seen = tf.while_loop(
            lambda s, *_: s < 3, inner, maximum_iterations=3,
            loop_vars=(0, h, tf.TensorArray(tf.float32, 3)))
        return t + 1, g, out.write(t, tf.reduce_mean(seen.stack(), 0))

    _, _, out = tf.while_loop(
        lambda t, *_: t < STEPS, outer, maximum_iterations=STEPS,
        loop_vars=(0, tf.zeros((BATCH, WIDTH)), tf.TensorArray(tf.float32, STEPS)))
    y = out.stack()
    marks.append(y)
    return _dense_layers(y, ws, marks)


def _scan(x, u, ws, marks):
    y = tf.scan(lambda h, xt: tf.tanh(xt + h @ u), x, initializer=tf.zeros((BATCH, WIDTH)))
    marks.append(y)
    return _dense_layers(y, ws, marks)


def _map_fn(x, u, ws, marks):
    pre = tf.tanh(x)
    marks.append(pre)
    y = tf.map_fn(lambda xt: tf.tanh(xt @ u), pre)
    marks.append(y)
    return _dense_layers(y, ws, marks)


def _foldl(x, u, ws, marks):
    """The fold's last state (no list leaves the loop) scales every step of x."""
    h = tf.foldl(lambda h, xt: tf.tanh(xt + h @ u), x, initializer=tf.zeros((BATCH, WIDTH)))
    y = x * h
    marks.append(y)
    return _dense_layers(y, ws, marks)


CONSTRUCTS = {
    "while_writes": _while_writes,
    "while_reads_and_writes": _while_reads_and_writes,
    "nested_loops": _nested_loops,
    "scan": _scan,
    "map_fn": _map_fn,
    "foldl": _foldl,
}

#: (name, checkpoints, options): every strategy, a budget (filled in from plan()), a list
STRATEGIES = [
    ("memory", "memory", {}),
    ("balanced", "balanced", {}),
    ("speed", "speed", {}),
    ("collection", "collection", {}),
    ("budget", "memory", {"memory_budget": None}),
    ("list", None, {}),
]


def _budget(loss, xs):
    """A budget halfway between the least predicted peak and plain's: it must keep something."""
    p = msg.plan(loss, xs, "memory")
    return (p.predicted_peak_bytes + p.baseline_peak_bytes) // 2


def _recomputed_since(graph, before: int) -> list:
    """Types of the recompute copies made after op id ``before``."""
    return [op.type for op in graph.get_operations()
            if op._id > before and "/recompute_" in op.name]  # pylint: disable=protected-access


def _last_id(graph) -> int:
    return max(op._id for op in graph.get_operations())  # pylint: disable=protected-access


def _all_gradients(construct, x, u, unused, ws):
    """tf.gradients and gradients() with every strategy, in the current graph.

    Returns (reference, {strategy: gradients}); asserts each call recomputed something.
    """
    marks: list = []
    loss = CONSTRUCTS[construct](x, u, ws, marks)
    graph = loss.graph
    for t in marks[1::2]:
        graph.add_to_collection("checkpoints", t)
    xs = [x, u, unused] + list(ws)
    reference = tf.compat.v1.gradients(loss, xs)
    ours = {}
    for name, checkpoints, options in STRATEGIES:
        if "memory_budget" in options:
            options = dict(options, memory_budget=_budget(loss, xs))
        before = _last_id(graph)
        ours[name] = msg.gradients(loss, xs, checkpoints=checkpoints or marks[::2], **options)
        assert _recomputed_since(graph, before), f"{construct}/{name}: nothing was recomputed"
    return reference, ours


def _assert_same(reference, got, what):
    """None pattern and values of ``got`` equal ``reference`` (numpy arrays or None)."""
    assert len(got) == len(reference)
    for i, (a, b) in enumerate(zip(reference, got)):
        assert (a is None) == (b is None), f"{what}: gradient {i}: plain {a is None}, ours {b is None}"
        if a is not None:
            assert a.dtype == b.dtype, f"{what}: gradient {i}"
            scale = max(1.0, float(np.abs(a).max()))
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * scale,
                                       err_msg=f"{what}: gradient {i}")


def _numpy(grads):
    return [None if g is None else np.asarray(g) for g in grads]


def _check_function(construct, jit_compile):
    x_value, u_value, w_values = _values()

    @tf.function(jit_compile=jit_compile)
    def step(x, u, unused, ws):
        return _all_gradients(construct, x, u, unused, ws)

    reference, ours = step(tf.constant(x_value), tf.constant(u_value), tf.constant(u_value),
                           [tf.constant(w) for w in w_values])
    reference = _numpy(reference)
    assert reference[2] is None and all(g is not None for i, g in enumerate(reference) if i != 2)
    for name, grads in ours.items():
        _assert_same(reference, _numpy(grads), f"{construct}/{name}")


def _check_v1_graph(construct, v1_control_flow):
    x_value, u_value, w_values = _values()
    graph = tf.Graph()
    with (control_flow_v1() if v1_control_flow else contextlib.nullcontext()), graph.as_default():
        reference, ours = _all_gradients(
            construct, tf.constant(x_value), tf.constant(u_value), tf.constant(u_value),
            [tf.constant(w) for w in w_values])
        types = {op.type for op in graph.get_operations()}
        if v1_control_flow:
            assert {"Enter", "Exit", "TensorArrayV3"} <= types and not types & {"While", "StatelessWhile"}
        else:
            assert types & {"While", "StatelessWhile"} and "Enter" not in types
        fetch = [[g for g in grads if g is not None] for grads in [reference] + list(ours.values())]
        with tf.compat.v1.Session(graph=graph) as sess:
            values = sess.run(fetch)

    def filled(grads, got):
        got = iter(got)
        return [None if g is None else next(got) for g in grads]

    plain = filled(reference, values[0])
    assert plain[2] is None
    for (name, grads), got in zip(ours.items(), values[1:]):
        _assert_same(plain, filled(grads, got), f"{construct}/{name}")


def _sample(full: list, ci: list) -> list:
    return full if FULL else ci


ALL = list(CONSTRUCTS)


@pytest.mark.slow
@pytest.mark.parametrize("construct", ALL)
def test_tf_function_every_strategy(construct):
    _check_function(construct, jit_compile=False)


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.parametrize("construct", _sample(ALL, ["while_writes", "nested_loops"]))
def test_xla_every_strategy(construct):
    _check_function(construct, jit_compile=True)


@pytest.mark.slow
@pytest.mark.parametrize("construct", ALL)
def test_v1_graph_v1_control_flow_every_strategy(construct):
    _check_v1_graph(construct, v1_control_flow=True)


@pytest.mark.slow
@pytest.mark.parametrize("construct", _sample(ALL, ["while_reads_and_writes"]))
def test_v1_graph_v2_control_flow_every_strategy(construct):
    _check_v1_graph(construct, v1_control_flow=False)


def test_v1_control_flow_setting_restored():
    assert tf.compat.v1.control_flow_v2_enabled()


# ----------------------------------------------------------------- the tape patch


TAPE_STRATEGIES = [("memory", {}), ("balanced", {}), ("speed", {}), ("collection", {}),
                   ("memory", {"memory_budget": None})]


def _check_tape(construct, jit_compile):
    """tape.gradient inside a tf.function under patched(...) equals the plain tape."""
    x_value, u_value, w_values = _values()
    u, unused = tf.Variable(u_value), tf.Variable(u_value)
    ws = [tf.Variable(w) for w in w_values]
    sources = [u, unused] + ws

    def taped():
        marks: list = []
        with tf.GradientTape() as tape:
            x = tf.constant(x_value)
            tape.watch(x)
            loss = CONSTRUCTS[construct](x, u, ws, marks)
            for t in marks[1::2]:
                tf.compat.v1.add_to_collection("checkpoints", t)
        return tape.gradient(loss, [x] + sources), loss, x

    @tf.function(jit_compile=jit_compile)
    def step():
        reference, loss, x = taped()
        graph = loss.graph
        ours = []
        for checkpoints, options in TAPE_STRATEGIES:
            if "memory_budget" in options:
                options = dict(options, memory_budget=_budget(loss, [x] + sources))
            before = _last_id(graph)
            with msg.patched(checkpoints, **options):
                grads, _, _ = taped()
            assert _recomputed_since(graph, before), f"{construct}/{checkpoints}{options}"
            ours.append(grads)
        return reference, ours

    reference, ours = step()
    reference = _numpy(reference)
    assert reference[2] is None and reference[1] is not None
    for (checkpoints, options), grads in zip(TAPE_STRATEGIES, ours):
        _assert_same(reference, _numpy(grads), f"tape {construct}/{checkpoints}{sorted(options)}")


@pytest.mark.slow
@pytest.mark.parametrize("construct", _sample(ALL, ["while_writes", "scan", "map_fn"]))
def test_tape_patch_every_strategy(construct):
    _check_tape(construct, jit_compile=False)


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.parametrize("construct", _sample(ALL, ["while_writes"]))
def test_tape_patch_under_xla(construct):
    _check_tape(construct, jit_compile=True)


def test_issue_repro_tape_gradient_of_loop_weight():
    """tape.gradient(loss, u) of the issue's loop under patch('memory') in a tf.function
    is plain's (it was None), and the dense layers after the loop are recomputed."""
    x_value, u_value, w_values = _values()
    u = tf.Variable(u_value)
    ws = [tf.Variable(w) for w in w_values]

    def gradient_of_u():
        with tf.GradientTape() as tape:
            loss = _while_writes(tf.constant(x_value), u, ws, [])
        return tape.gradient(loss, u)

    plain = tf.function(gradient_of_u)()
    handle = msg.patch("memory")
    try:
        ours = tf.function(gradient_of_u)()
    finally:
        handle.undo()
    assert ours is not None
    np.testing.assert_allclose(ours.numpy(), plain.numpy(), rtol=1e-4, atol=1e-5)


def test_tape_variant_and_handle_sources(caplog):
    """Sources that are TensorArray flows (variants) and a variable's handle: as the plain
    tape (the handle, an eager tensor inside the tf.function, falls back to it, and says so)."""
    x_value, u_value, w_values = _values()
    u = tf.Variable(u_value)
    ws = [tf.Variable(w) for w in w_values]

    def step(with_handle, checkpointed=False):
        with tf.GradientTape() as tape:
            x = tf.constant(x_value)
            inputs = tf.TensorArray(tf.float32, STEPS).unstack(tf.tanh(x))
            tape.watch(inputs.flow)

            def body(t, h, out):
                h = tf.tanh(inputs.read(t) + h @ u)
                return t + 1, h, out.write(t, h)

            _, _, out = tf.while_loop(
                lambda t, *_: t < STEPS, body,
                (0, tf.zeros((BATCH, WIDTH)), tf.TensorArray(tf.float32, STEPS)))
            loss = _dense_layers(out.stack(), ws, [])
        sources = {"inputs": inputs.flow, "outputs": out.flow, "u": u}
        if with_handle:
            sources["handle"] = u.handle
        before = _last_id(loss.graph)
        grads = tape.gradient(loss, sources)
        assert bool(_recomputed_since(loss.graph, before)) == checkpointed
        assert grads["inputs"].dtype == tf.variant
        # a list's gradient is a list: compare what it holds
        for name in ("inputs", "outputs"):
            grads[name] = tf.raw_ops.TensorListStack(
                input_handle=grads[name], element_shape=[BATCH, WIDTH], element_dtype=tf.float32)
        return grads

    for with_handle in (False, True):
        plain = tf.function(step)(with_handle)
        with msg.patched("memory"), caplog.at_level(logging.WARNING, "memory_saving_gradients"):
            caplog.clear()
            ours = tf.function(step)(with_handle, checkpointed=not with_handle)
        assert (with_handle and "eager tensor" in caplog.text) or not caplog.text, caplog.text
        assert set(ours) == set(plain)
        for name in plain:
            np.testing.assert_allclose(ours[name].numpy(), plain[name].numpy(), rtol=1e-4,
                                       atol=1e-5, err_msg=name)


def _reads_output_of(copy, ops, dtype) -> bool:
    """Whether ``copy`` reads a ``dtype`` output of one of ``ops``, directly or through
    the identity (proxy) the rewrite puts before a segment's inputs."""
    for t in copy.inputs:
        sources = [t] + (list(t.op.inputs) if t.op.type == "Identity" else [])
        if t.dtype == dtype and any(s.op in ops for s in sources):
            return True
    return False


def test_loop_kept_whole_rest_recomputed():
    """A loop plus a deep MLP after it: 'memory' keeps tensors after the loop and the dense
    layers' copies run; with the stacked output left out of a checkpoint list, no copy
    reads the loop's variant output (a TensorList holds bytes the memory model cannot
    see: the stack is kept, not recomputed from it); gradients equal."""
    x_value, u_value, w_values = _values()

    @tf.function
    def step(x, u, ws):
        marks = []
        loss = _while_writes(x, u, ws, marks)
        graph = loss.graph
        loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
        plan = msg.plan(loss, [u] + ws, "memory")
        assert plan.checkpoints and all(t.op not in loops for t in plan.checkpoints), plan
        reference = tf.compat.v1.gradients(loss, [u] + ws)
        results = {}
        for name, checkpoints in (("memory", "memory"), ("list", marks[2::2])):
            before = _last_id(graph)
            results[name] = msg.gradients(loss, [u] + ws, checkpoints=checkpoints)
            copies = [op for op in graph.get_operations()
                      if op._id > before and "/recompute_" in op.name]  # pylint: disable=protected-access
            types = [op.type for op in copies]
            assert types.count("MatMul") >= 2 and "Tanh" in types, (name, types)
            assert not set(types) & {"While", "StatelessWhile"}, (name, types)
        assert not any(_reads_output_of(op, loops, tf.variant) for op in copies), \
            "a copy reads the loop's variant output"
        return reference, results

    reference, results = step(tf.constant(x_value), tf.constant(u_value),
                              [tf.constant(w) for w in w_values])
    for name, ours in results.items():
        _assert_same(_numpy(reference), _numpy(ours), f"while_writes/{name}")


# ----------------------------------------------------------------- Keras RNN layers


RNN_STEPS, RNN_FEATURES, RNN_BATCH = 8, 12, 16


def _rnn_model(kind: str):
    keras.utils.set_random_seed(1)
    if kind == "ConvLSTM2D":
        inputs = keras.Input((RNN_STEPS, 6, 6, 3))
        h = keras.layers.ConvLSTM2D(4, 3, padding="same", return_sequences=True)(inputs)
    else:
        inputs = keras.Input((RNN_STEPS, RNN_FEATURES))
        layer = {
            "LSTM": lambda: keras.layers.LSTM(16, return_sequences=True),
            "GRU": lambda: keras.layers.GRU(16, return_sequences=True),
            "SimpleRNN": lambda: keras.layers.SimpleRNN(16, return_sequences=True),
            "Bidirectional": lambda: keras.layers.Bidirectional(
                keras.layers.LSTM(8, return_sequences=True)),
        }[kind]
        h = layer()(inputs)
    for _ in range(6):  # on every step: activations outweigh the weights
        h = keras.layers.Dense(64, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(h)))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _rnn_data(kind: str):
    rng = np.random.default_rng(0)
    shape = (RNN_STEPS, 6, 6, 3) if kind == "ConvLSTM2D" else (RNN_STEPS, RNN_FEATURES)
    x = rng.normal(size=(2 * RNN_BATCH,) + shape).astype(np.float32)
    y = rng.normal(size=(2 * RNN_BATCH, 1)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(RNN_BATCH)  # batch None


#: The batch the planner assumes (the graph's is None): large enough that it recomputes
#: the segment right after the loop, whose TensorListStack reads the loop's output.
PLANNED_BATCH = 2048


def _fit(kind: str, how: str):
    """Initial and final weights after one epoch (two SGD steps), and the variables' paths."""
    model = _rnn_model(kind)
    initial = [v.numpy().copy() for v in model.trainable_variables]
    if how == "enable":
        msg.keras.enable(model, "memory", batch_size=PLANNED_BATCH)
        model.fit(_rnn_data(kind), epochs=1, verbose=0, shuffle=False)
    elif how == "patched":
        with msg.patched("memory", batch_size=PLANNED_BATCH):
            model.fit(_rnn_data(kind), epochs=1, verbose=0, shuffle=False)
    else:
        model.fit(_rnn_data(kind), epochs=1, verbose=0, shuffle=False)
    return initial, [v.numpy() for v in model.trainable_variables], \
        [v.path for v in model.trainable_variables]


@functools.lru_cache(maxsize=None)
def _plain_fit(kind: str):
    return _fit(kind, "plain")


RNN_CASES = [("LSTM", "patched"), ("LSTM", "enable"), ("GRU", "patched"), ("GRU", "enable"),
             ("SimpleRNN", "enable"), ("Bidirectional", "patched"), ("ConvLSTM2D", "enable")]
if FULL:
    RNN_CASES += [("SimpleRNN", "patched"), ("Bidirectional", "enable"), ("ConvLSTM2D", "patched")]


@pytest.mark.slow
@pytest.mark.keras
@pytest.mark.skipif(keras is None, reason="keras is not installed")
@pytest.mark.parametrize("kind,how", RNN_CASES)
def test_keras_rnn_fit_updates_every_variable_as_plain(kind, how, recorded_graphs):
    """fit on tf.data: every trainable variable changes, by plain fit's update."""
    initial, plain, paths = _plain_fit(kind)
    ours_initial, ours, _ = _fit(kind, how)
    for a, b in zip(initial, ours_initial):
        np.testing.assert_array_equal(a, b)
    assert recorded_graphs, "gradients() was never called"
    copies = [op.type for g in recorded_graphs for op in g.get_operations()
              if "/recompute_" in op.name]
    assert copies and not [t for t in copies if t.startswith("TensorList")], sorted(set(copies))
    for path, start, theirs, mine in zip(paths, initial, plain, ours):
        update, expected = mine - start, theirs - start
        assert np.abs(expected).max() > 0, f"{path}: plain fit did not change it"
        assert np.abs(update).max() > 0, f"{path} was not updated"
        np.testing.assert_allclose(update, expected, rtol=1e-3,
                                   atol=1e-4 * float(np.abs(expected).max()), err_msg=path)


# ----------------------------------------------------------------- memory


@pytest.mark.memory
def test_loop_then_mlp_saves_memory_as_planned(measure_peak):
    """The issue's loop (T=16, batch 256, width 256) and 8 dense layers after it, in a v1
    graph: 'memory' recomputes the layers after the loop and measures at most 0.7x plain's
    allocator peak (measured 28.75 MiB against 44.25 MiB); plan() is within 20% of both
    measured peaks, variant edges included.  Predicted 32.0 and 52.0 MiB: the model counts
    what the loop keeps of each iteration for its gradient (its tanh, 16 x 256 KiB, the
    buffer its TensorArray holds too); before it did (24.0 and 48.0 MiB) plain's figure
    was over by 8% with the loop's 4 MiB left out, and what else it over-counts by 4-8
    MiB here is not known."""
    steps, batch, width = 16, 256, 256
    rng = np.random.default_rng(0)
    x_value = rng.normal(size=(steps, batch, width)).astype(np.float32)
    u_value, *w_values = [(rng.normal(size=(width, width)) * 0.05).astype(np.float32)
                          for _ in range(DEPTH + 1)]
    peaks, plans, values = {}, {}, {}
    for mode in ("plain", "memory"):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, (steps, batch, width))
            u = tf.constant(u_value)
            ws = [tf.constant(w) for w in w_values]

            def body(t, h, out):
                h = tf.tanh(x[t] + h @ u)
                return t + 1, h, out.write(t, h)

            _, _, out = tf.while_loop(lambda t, *_: t < steps, body,
                                      (0, tf.zeros((batch, width)), tf.TensorArray(tf.float32, steps)))
            y = out.stack()
            for w in ws:
                y = tf.tanh(tf.matmul(tf.reshape(y, [-1, width]), w))
            loss = tf.reduce_sum(y * y)
            xs = [u] + ws
            plan = msg.plan(loss, xs, "memory")
            plans[mode] = plan.baseline_peak_bytes if mode == "plain" else plan.predicted_peak_bytes
            grads = (tf.compat.v1.gradients(loss, xs) if mode == "plain"
                     else msg.gradients(loss, xs, checkpoints="memory"))
            assert all(g is not None for g in grads)
            peaks[mode], _ = measure_peak(grads, {x: x_value})
            with tf.compat.v1.Session() as sess:
                values[mode] = sess.run(grads, {x: x_value})
    for a, b in zip(values["plain"], values["memory"]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    assert peaks["memory"] <= 0.7 * peaks["plain"], peaks
    for mode in peaks:
        assert abs(plans[mode] - peaks[mode]) <= 0.2 * peaks[mode], (mode, plans, peaks)


def _recurrent_step(batch):
    """A Keras stack of LSTM, GRU and bidirectional LSTM layers (every one a while loop
    over TensorLists) and its training step's gradients."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((20,), dtype="int32")
    h = keras.layers.Embedding(500, 32)(inputs)
    h = keras.layers.LSTM(128, return_sequences=True)(h)
    h = keras.layers.GRU(128, return_sequences=True)(h)
    h = keras.layers.Bidirectional(keras.layers.LSTM(64, return_sequences=True))(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.LSTM(64)(h)))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(1, 500, (batch, 20)).astype("int32"))
    y = tf.constant(rng.standard_normal((batch, 1)).astype("float32"))

    def make():  # the batch unknown, as from a dataset
        @tf.function(input_signature=[tf.TensorSpec([None, 20], tf.int32),
                                      tf.TensorSpec([None, 1], tf.float32)])
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            return tape.gradient(loss, model.trainable_variables)
        return step
    return make, x, y


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.own_process
def test_recurrent_layers_keep_no_tensor_list_and_hold_no_more_than_plain():
    """A TensorList holds a whole sequence whose bytes the memory model cannot see:
    no variant is kept as a checkpoint and no op on one is recomputed, so the
    measured peak of a Keras recurrent stack is not above plain's (it was 1.07x with
    the lists kept); where the model predicts no saving, the patch falls back and says
    so. Slack: 3% of plain's peak, the spread of three steps measured alone (123.25 to
    126.75 MiB for each, both falling back to tf.gradients).  In a process of its own,
    each the least of three steps taken in turn: in a two-worker run plain's least was
    122.75 against 126.75."""
    make, x, y = _recurrent_step(512)
    plain_step = make()
    want = plain_step(x, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with msg.patched("memory") as handle:
            ours_step = make()
            got = ours_step(x, y)
    plain, ours = (min(peaks) for peaks in zip(*[
        (msg.peak_memory_during(lambda: plain_step(x, y)),
         msg.peak_memory_during(lambda: ours_step(x, y))) for _ in range(3)]))
    # the memory model now predicts no saving here (what the loops keep dominates): the
    # patch then falls back to plain tf.gradients, and says so
    fell_back = [w for w in caught if issubclass(w.category, msg.NothingKeptWarning)]
    assert handle.plans or fell_back, [str(w.message) for w in caught]
    for plan in handle.plans:
        assert not [t for t in plan.checkpoints if t.dtype == tf.variant], plan.checkpoints
        assert not [kind for kind, _ in plan.recomputed_ops if kind.startswith("TensorList")], plan
        assert "TensorLists: both peaks count them from each loop's body" in str(plan), plan
    assert ours <= 1.03 * plain, (ours / 2**20, plain / 2**20)
    for a, b in zip(want, got):
        a, b = (tf.convert_to_tensor(g).numpy() for g in (a, b))
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * np.abs(a).max())


def _recurrent_stack_step(batch, steps, masked):
    """LSTM(128) -> GRU(128) -> LSTM(128) over an embedding (masked or not), its
    tf.function training step (batch unknown), a function planning it at ``batch``,
    and a batch: at batch 512 every tensor a loop keeps is 256 KiB, large enough for
    the CPU allocator's statistics (``profiling.peak_memory_during``) to see."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((steps,), dtype="int32")
    h = keras.layers.Embedding(500, 32, mask_zero=masked)(inputs)
    h = keras.layers.LSTM(128, return_sequences=True)(h)
    h = keras.layers.GRU(128, return_sequences=True)(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.LSTM(128)(h)))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 500, (batch, steps)).astype("int32")
    ids[:, 3 * steps // 4:] = 0  # padding: masked by the embedding where masked
    x, y = tf.constant(ids), tf.constant(rng.standard_normal((batch, 1)).astype("float32"))
    signature = [tf.TensorSpec([None, steps], tf.int32), tf.TensorSpec([None, 1], tf.float32)]

    def loss_of(x, y):
        return tf.reduce_mean(tf.square(model(x, training=True) - y))

    def make():
        @tf.function(input_signature=signature)
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_of(x, y)
            return tape.gradient(loss, model.trainable_variables)
        return step

    plans = []

    @tf.function(input_signature=signature)
    def planned(x, y):
        loss = loss_of(x, y)
        plans.append(msg.plan(loss, model.trainable_variables, "memory", batch_size=batch))
        return loss

    def plan():
        planned.get_concrete_function()
        return plans[-1]
    return make, plan, x, y


@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_recurrent_stack_peak_counts_what_the_loops_keep(masked):
    """What a while loop keeps of each iteration for its gradient (pushed on TensorLists
    when the gradient is built) is counted, with what an unknown batch adds (the zeros
    each loop's gradient writes per step): plan()'s plain peak of a recurrent stack is
    within 10% of the measured peak (measured 2% over unmasked, 4% masked; masked was
    15% over while zeros were counted for items whose popped buffer zeros_like reuses),
    where it predicted a tenth of it before the loops were counted.
    'memory' measures at most 3% above plain (it measured 1.03-1.09x with the loops
    uncounted), and its plan's predicted ratio is the measured one within 0.05:
    recomputing nothing of weight, it predicted 0.92x where the step measured 1.00x
    before the zeros and Shape reads were modelled."""
    make, plan, x, y = _recurrent_stack_step(512, 20, masked)
    plain_step = make()
    want = plain_step(x, y)
    plain = min(msg.peak_memory_during(lambda: plain_step(x, y)) for _ in range(3))
    predicted = plan().baseline_peak_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", msg.NothingKeptWarning)
        warnings.simplefilter("ignore", msg.NothingRewrittenWarning)
        with msg.patched("memory"):
            ours_step = make()
            got = ours_step(x, y)
    ours = min(msg.peak_memory_during(lambda: ours_step(x, y)) for _ in range(3))
    summary = (f"plain measured {plain / 2**20:.1f} MB, predicted {predicted / 2**20:.1f} MB; "
               f"'memory' measured {ours / 2**20:.1f} MB")
    assert abs(predicted - plain) <= 0.1 * plain, summary
    assert ours <= 1.03 * plain, summary
    planned = plan()  # the saving it predicts is the one measured, within 5% of plain's peak
    assert abs(planned.predicted_ratio - ours / plain) <= 0.05, (summary, str(planned))
    for a, b in zip(want, got):
        a, b = (tf.convert_to_tensor(g).numpy() for g in (a, b))
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * np.abs(a).max())


@pytest.mark.unit
def test_a_counted_loop_s_trip_count_is_read_from_its_condition():
    """``tf.while_loop(lambda i, h: i < 6, ...)`` and autograph's ``for i in
    tf.range(...)`` with static bounds have no ``maximum_iterations``: their trip count
    is the condition's (start, step and limit static, either comparison, either side);
    a limit made at run time leaves it unknown."""
    from memory_saving_gradients import graph as graph_lib

    w = tf.Variable(tf.ones([4, 4]))

    @tf.function
    def loops(x):
        h = x
        for test, start, step in ((lambda i, h: i < 6, 0, 1), (lambda i, h: i <= 10, 1, 3),
                                  (lambda i, h: 0 < i, 7, -2), (lambda i, h: i >= 0.5, 2.0, -0.5)):
            _, h = tf.while_loop(test, lambda i, h, step=step: (i + step, tf.tanh(h @ w)),
                                 (start, h))
        for _ in tf.range(2, 11, 4):
            h = tf.tanh(h @ w)
        for _ in tf.range(tf.shape(x)[0]):
            h = tf.tanh(h @ w)
        return h

    graph = loops.get_concrete_function(tf.TensorSpec([None, 4])).graph
    counts = [graph_lib.loop_accumulators(op).steps for op in graph.get_operations()
              if op.type in graph_lib.WHILE_OP_TYPES]
    assert counts == [6, 4, 4, 4, 3, None], counts


@pytest.mark.memory
@pytest.mark.parametrize("trips", [6, 24])
def test_a_counted_loop_is_planned_at_its_trip_count(trips):
    """Six or 24 steps of ``h = tanh(h @ w)`` in a ``tf.while_loop`` with a constant bound,
    between dense layers (batch 512, width 256: 512 KiB tensors, which the allocator's
    statistics see). The loop was planned as 32 steps whatever its bound: plain 25.5 MB
    predicted against 11.75 (6 steps) and 20.75 (24) measured. Now both peaks are within
    15% of the measured ones (13.0 / 8.0 MB predicted, 12.0 / 8.0 measured at 6 steps; 22.0 /
    17.5 against 20.75-21.0 / 17.5-17.75 at 24), and the step saves at least half of what the
    plan predicts."""
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.standard_normal((256, 256)).astype("float32") / 16)
               for _ in range(9)]
    x = tf.constant(rng.standard_normal((512, 256)), tf.float32)

    def make():
        @tf.function
        def grads(x):
            with tf.GradientTape() as tape:
                h = x
                for w in weights[:4]:
                    h = tf.tanh(tf.tanh(h @ w))
                _, h = tf.while_loop(lambda i, h: i < trips,
                                     lambda i, h: (i + 1, tf.tanh(h @ weights[4])), (0, h))
                for w in weights[5:]:
                    h = tf.tanh(tf.tanh(h @ w))
                loss = tf.reduce_sum(h * h)
            return tape.gradient(loss, weights)
        return grads

    def peak(step):
        step(x)
        return min(msg.peak_memory_during(lambda: [g.numpy() for g in step(x)])
                   for _ in range(3))

    plain = peak(make())
    ours = make()
    with msg.patched("memory") as handle:
        ours.get_concrete_function(x)
    measured = peak(ours)
    (the_plan,) = handle.plans
    summary = f"measured plain {plain / 2**20:.2f} MiB, 'memory' {measured / 2**20:.2f};\n{the_plan}"
    assert not any("no static trip count" in a for a in the_plan.assumptions), summary
    assert abs(the_plan.baseline_peak_bytes - plain) <= 0.15 * plain, summary
    assert abs(the_plan.predicted_peak_bytes - measured) <= 0.15 * measured, summary
    # At least half the predicted saving (24 steps: 4.5 MB predicted, 3.0-3.5 measured; the
    # allocator's peak moves by a 512 KiB tensor or two with the executor's order under load).
    predicted_saving = the_plan.baseline_peak_bytes - the_plan.predicted_peak_bytes
    assert plain - measured >= 0.5 * predicted_saving > 0, summary


@pytest.mark.unit
def test_plans_are_remembered_per_trip_count():
    """Plans are remembered by the forward region's structure (a retrace is not planned
    again). Two loops that differ only in their bound have the same outputs, so a plan
    made for 6 steps was reused for 24 (planned at 13 MB, measured 21): the structure
    includes what each loop keeps and how often."""
    from memory_saving_gradients import graph as graph_lib
    from memory_saving_gradients import memo

    def fingerprint(trips):
        w = tf.Variable(tf.ones([8, 8]))

        @tf.function
        def loss(x):
            _, h = tf.while_loop(lambda i, h: i < trips, lambda i, h: (i + 1, tf.tanh(h @ w)),
                                 (0, x))
            return tf.reduce_sum(h)

        graph = loss.get_concrete_function(tf.TensorSpec([4, 8])).graph
        y = graph.outputs[0]
        xs = [graph.inputs[0]]
        return memo.fingerprint(graph_lib.forward_region([y], xs), [y], xs)

    assert fingerprint(6) == fingerprint(6)
    assert fingerprint(6) != fingerprint(24)


@pytest.mark.unit
def test_a_loop_run_as_many_times_as_a_tensor_says_makes_the_plan_depend_on_it():
    """Every shape known but a loop's trip count (a tensor argument): its steps are
    counted as the unknown size, so the plan is given at that size (``plan.batch``),
    ``batch_size=`` sets it and ``peak_at`` gives the peaks at others. The plan said
    its figures held at any size (``batch`` None, ``peak_at`` refused) while counting
    32 steps."""
    w = tf.Variable(tf.random.stateless_normal([64, 64], seed=(1, 2)) * 0.1)
    plans = {}

    @tf.function(input_signature=[tf.TensorSpec([16, 64]), tf.TensorSpec([], tf.int32)])
    def step(x, n):
        h = x
        for _ in range(4):
            h = tf.tanh(h @ w)
        _, h = tf.while_loop(lambda i, h: i < n, lambda i, h: (i + 1, tf.tanh(h @ w)), (0, h))
        loss = tf.reduce_sum(h)
        plans["default"] = msg.plan(loss, [w], checkpoints="memory")
        plans["stated"] = msg.plan(loss, [w], checkpoints="memory", batch_size=512)
        return loss

    step.get_concrete_function()
    default, stated = plans["default"], plans["stated"]
    assert default.batch == 32 and stated.batch == 512, (default, stated)
    assert not default.batch_known
    assert any("no static trip count" in a and "counted as 32" in a for a in default.assumptions)
    # each step keeps a 16x64 float32 tensor or two: 480 more steps hold at least 480*4 KiB
    grown = default.peak_at(512, plain=True) - default.baseline_peak_bytes
    assert grown >= 480 * 16 * 64 * 4, (grown, default)
    assert default.peak_at(512, plain=True) == stated.baseline_peak_bytes

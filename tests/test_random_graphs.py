"""Property test: on random graphs, ``gradients()`` equals ``tf.compat.v1.gradients``.

Hypothesis draws a small random program (a DAG of differentiable ops on
broadcast-compatible shapes: unary maps, broadcasting binary ops, matmul,
concat + split / unstack, reductions over an axis, gather, casts through
integers, stop_gradient; and what users build: ``tf.while_loop`` carrying
state and writing a ``TensorArray``, ``tf.cond`` on a data-dependent
predicate, embedding lookups of a variable table (``IndexedSlices``
gradients, made dense where the table is also read whole),
``tf.custom_gradient`` (one of them gives None for an input), stateful
random ops (``tf.random.uniform``, dropout), and the patterns grappler's
remapper fuses under oneDNN: conv + bias + activation, matmul + bias (+
relu)), random ``xs`` (placeholders, intermediates, integer tensors,
duplicates, variables), one or several ``ys``, random ``grad_ys`` (some
None), random checkpoint lists, and sometimes ``stop_gradients`` or
``unconnected_gradients='zero'``.  For every example one graph is built and
differentiated by TensorFlow, by ``gradients()`` with two checkpoint lists
(the random one, and every float value), and by ``gradients()`` with every
strategy in ``available_strategies()``; one session (default config: grappler
on) runs them all.  Each result must have TensorFlow's None pattern, kind
(dense / ``IndexedSlices``), dtype and values (within float tolerance), and no
call may have taken the guard's fallback to ``tf.gradients``
(a ``FallbackWarning``): the rewrite itself must be right.  A tenth as many
smaller examples run the same comparison inside a ``tf.function`` body.

``tests/run_random_graphs.py`` runs the same property on thousands of examples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import types
import warnings
from typing import List, Optional, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf
from gradient_values import dense, kind
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memory_saving_gradients as msg
from memory_saving_gradients._tensorflow import tf_gradients
from memory_saving_gradients.notices import FallbackWarning

N = 3  # every float tensor has a shape broadcastable to (N, N)
SHAPES = [(), (N,), (1, N), (N, 1), (N, N)]
UNARY = ["tanh", "sigmoid", "square", "exp_clip", "sin", "softplus", "neg", "scale",
         "identity", "log1p_sq", "relu"]
BINARY = ["add", "sub", "mul", "div_safe", "add_n"]
REDUCE = ["sum", "mean", "max"]


#: Variables every program has (xs may name them): an embedding table, dense and
#: conv weights with their biases.
TABLE_ROWS = 5
CHANNELS = 2
VARIABLES = {"table": (TABLE_ROWS, N), "w": (N, N), "b": (N,), "filter": (3, 3, 1, CHANNELS),
             "conv_bias": (CHANNELS,)}
IDS = [[4, 0, 4], [1, 3, 1], [2, 2, 0]]


@dataclasses.dataclass(frozen=True)
class Node:
    kind: str          # 'unary', 'binary', 'matmul', 'split', 'unstack', 'reduce',
                       # 'gather', 'to_int', 'from_int', 'stop', 'while', 'cond',
                       # 'embed', 'table_mean', 'custom', 'random', 'conv', 'dense'
    fn: str            # sub-kind (op name, reduction, ...)
    args: Tuple[int, ...]  # indices of earlier values
    param: int = 0     # axis, transpose flags, ...


@dataclasses.dataclass(frozen=True)
class Program:
    dtype: str
    inputs: Tuple[Tuple[int, ...], ...]     # placeholder shapes
    nodes: Tuple[Node, ...]
    xs: Tuple[int, ...]
    ys: Tuple[int, ...]
    grad_ys: Tuple[Optional[int], ...]      # seed of each grad_y, or None
    checkpoints: Tuple[int, ...]
    stop_gradients: Tuple[int, ...]
    unconnected_zero: bool
    seed: int
    var_xs: Tuple[str, ...] = ()            # names of VARIABLES that are xs too


def _broadcast(a, b):
    return tuple(np.broadcast_shapes(a, b))


def _node_outputs(node: Node, shapes: list, is_int: list) -> List[Tuple[tuple, bool]]:
    """(shape, is_int) of each output a node adds to the value list."""
    k = node.kind
    a = shapes[node.args[0]] if node.args else None
    if k in ("unary", "stop"):
        return [(a, False)]
    if k == "binary":
        out = a
        for i in node.args[1:]:
            out = _broadcast(out, shapes[i])
        return [(out, False)]
    if k == "matmul":
        return [((N, N), False)]
    if k == "split":
        return [((N, N), False), ((N, N), False)]
    if k == "unstack":
        return [((N,), False)] * N
    if k == "reduce":
        return [(_reduced_shape(a, node.param), False)]
    if k == "gather":
        return [((N,) + tuple(a[1:]) if len(a) else (N,), False)]
    if k == "to_int":
        return [(a, True)]
    if k == "from_int":
        return [(_broadcast(a, shapes[node.args[1]]), False)]
    if k == "while":
        return [((N, N), False), ((N, N), False)]
    if k in ("cond", "custom"):
        return [(_broadcast(a, shapes[node.args[1]]), False)]
    if k in ("embed", "conv", "dense"):
        return [((N, N), False)]
    if k == "table_mean":
        return [((N,), False)]
    if k == "random":
        return [(a, False)]
    raise AssertionError(k)


def _reduced_shape(shape, param):
    """param: 0 = all axes; 1 = axis 0 keepdims; 2 = last axis keepdims; 3 = last axis."""
    if len(shape) == 0 or param == 0:
        return ()
    if param == 1:
        return (1,) + tuple(shape[1:])
    if param == 2:
        return tuple(shape[:-1]) + (1,)
    return tuple(shape[:-1])


@st.composite
def programs(draw, max_nodes: int = 12) -> Program:
    dtype = draw(st.sampled_from(["float32", "float64"]))
    n_inputs = draw(st.integers(1, 3))
    inputs = tuple(draw(st.sampled_from(SHAPES)) for _ in range(n_inputs))
    shapes = list(inputs)
    is_int = [False] * n_inputs
    nodes = []
    for _ in range(draw(st.integers(1, max_nodes))):
        floats = [i for i, f in enumerate(is_int) if not f]
        ints = [i for i, f in enumerate(is_int) if f]
        # prefer recent values, so graphs are deep as well as wide
        pick = st.sampled_from(floats[-6:]) | st.sampled_from(floats)
        kinds = ["unary"] * 4 + ["binary"] * 4 + ["matmul", "split", "unstack", "reduce",
                                                  "reduce", "gather", "to_int", "stop"]
        kinds += ["while", "cond", "embed", "embed", "table_mean", "custom", "random",
                  "conv", "dense", "dense"]
        if ints:
            kinds += ["from_int"] * 2
        kind = draw(st.sampled_from(kinds))
        if kind == "unary":
            node = Node(kind, draw(st.sampled_from(UNARY)), (draw(pick),))
        elif kind == "binary":
            fn = draw(st.sampled_from(BINARY))
            arity = draw(st.integers(2, 3)) if fn == "add_n" else 2
            node = Node(kind, fn, tuple(draw(pick) for _ in range(arity)))
        elif kind == "matmul":
            node = Node(kind, "matmul", (draw(pick), draw(pick)), draw(st.integers(0, 3)))
        elif kind in ("split", "unstack"):
            node = Node(kind, kind, (draw(pick), draw(pick)), draw(st.integers(0, 1)))
        elif kind == "reduce":
            node = Node(kind, draw(st.sampled_from(REDUCE)), (draw(pick),), draw(st.integers(0, 3)))
        elif kind == "gather":
            node = Node(kind, "gather", (draw(pick),), draw(st.integers(0, 2)))
        elif kind == "from_int":
            node = Node(kind, "from_int", (draw(st.sampled_from(ints)), draw(pick)))
        elif kind in ("while", "cond", "custom"):
            # while: param = steps (1-3) + 4 * (write a TensorArray); custom: param 1
            # gives b a gradient, 0 gives None
            param = {"while": draw(st.integers(1, 3)) + 4 * draw(st.integers(0, 1)),
                     "cond": 0, "custom": draw(st.integers(0, 1))}[kind]
            node = Node(kind, kind, (draw(pick), draw(pick)), param)
        elif kind in ("embed", "table_mean"):
            node = Node(kind, kind, (), draw(st.integers(0, len(IDS) - 1)))
        elif kind in ("random", "conv", "dense"):
            # random: 0 uniform noise, 1 dropout; conv: 0 relu, 1 tanh, 2 none;
            # dense: 0 bias_add + relu, 1 bias_add, 2 + bias then relu
            node = Node(kind, kind, (draw(pick),), draw(st.integers(0, 1 if kind == "random" else 2)))
        else:
            node = Node(kind, kind, (draw(pick),))
        if kind == "gather" and shapes[node.args[0]][:1] != (N,):
            node = Node("unary", "tanh", node.args)  # gather needs N rows
        try:
            outs = _node_outputs(node, shapes, is_int)
        except ValueError:
            continue
        nodes.append(node)
        for shape, integer in outs:
            shapes.append(shape)
            is_int.append(integer)
    n = len(shapes)
    floats = [i for i in range(n) if not is_int[i]]
    any_value = st.integers(0, n - 1)
    late_float = st.sampled_from(floats[-4:]) | st.sampled_from(floats)
    x_choice = any_value | st.integers(0, n_inputs - 1)
    ints = [i for i in range(n) if is_int[i]]
    if ints:
        x_choice = x_choice | st.sampled_from(ints)
    xs = tuple(draw(st.lists(x_choice, min_size=1, max_size=3)))
    ys = tuple(draw(st.lists(late_float, min_size=1, max_size=3)))
    grad_ys = tuple(draw(st.none() | st.integers(0, 2**16)) for _ in ys)
    checkpoints = tuple(draw(st.lists(any_value, min_size=1, max_size=6)))
    stop_gradients = tuple(draw(st.lists(any_value, max_size=1))) if draw(
        st.integers(0, 9)) == 0 else ()
    unconnected_zero = draw(st.integers(0, 7)) == 0
    seed = draw(st.integers(0, 2**16))
    var_xs = tuple(draw(st.lists(st.sampled_from(sorted(VARIABLES)), max_size=3)))
    return Program(dtype, inputs, tuple(nodes), xs, ys, grad_ys, checkpoints,
                   stop_gradients, unconnected_zero, seed, var_xs)


_UNARY_FNS = {
    "tanh": tf.tanh,
    "sigmoid": tf.sigmoid,
    "square": lambda a: tf.square(a) * 0.5,
    "exp_clip": lambda a: tf.exp(tf.clip_by_value(a, -3.0, 3.0)),
    "sin": tf.sin,
    "softplus": tf.nn.softplus,
    "neg": tf.negative,
    "scale": lambda a: a * 0.75,
    "identity": tf.identity,
    "log1p_sq": lambda a: tf.math.log1p(tf.square(a)),
    "relu": tf.nn.relu,
}


def _reduce(fn, a, param):
    f = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max}[fn]
    rank = a.shape.rank
    if rank == 0 or param == 0:
        return f(a)
    if param == 1:
        return f(a, axis=0, keepdims=True)
    return f(a, axis=rank - 1, keepdims=(param == 2))


def make_variables(dtype, seed: int = 0) -> dict:
    """The VARIABLES, with fixed random values."""
    rng = np.random.RandomState(seed)
    return {name: tf.Variable(rng.uniform(-1, 1, size=shape).astype(dtype.as_numpy_dtype),
                              name=name)
            for name, shape in sorted(VARIABLES.items())}


@tf.custom_gradient
def _scaled_tanh_none(a, b):
    """a * tanh(b); its gradient passes none to b (a custom gradient may)."""
    y = a * tf.tanh(b)
    return y, lambda dy: (dy * tf.tanh(b), None)


@tf.custom_gradient
def _scaled_tanh(a, b):
    """a * tanh(b) with its exact gradient, written by hand."""
    t = tf.tanh(b)
    return a * t, lambda dy: (dy * t, dy * a * (1.0 - t * t))


def _loop(a, b, steps: int, write: bool):
    """A while loop carrying h (and a TensorArray of every h when ``write``)."""
    a, b = (tf.broadcast_to(t, [N, N]) for t in (a, b))
    array = tf.TensorArray(a.dtype, size=steps)

    def body(i, h, acc, array):
        h = tf.tanh(h * a + b * 0.5)
        array = array.write(i, h) if write else array
        return i + 1, h, acc + h * b, array

    _, h, acc, array = tf.while_loop(
        lambda i, *_: i < steps, body, [tf.constant(0), a * 0.5, tf.zeros_like(a), array])
    return [h, tf.reduce_sum(array.stack(), axis=0) if write else acc]


def _build_user_node(node: Node, args: list, dtype, variables: dict) -> list:
    """The constructs users build: loops, conds, embeddings, custom gradients,
    random ops, and the conv / matmul patterns the remapper fuses."""
    k = node.kind
    if k == "while":
        return _loop(args[0], args[1], node.param % 4, node.param >= 4)
    if k == "cond":
        a, b = args
        return [tf.cond(tf.reduce_sum(a) > 0, lambda: tf.tanh(a) * b, lambda: b - a * a)]
    if k == "custom":
        shape = _broadcast_all([t.shape for t in args])
        a, b = (tf.broadcast_to(t, shape) for t in args)
        return [(_scaled_tanh if node.param else _scaled_tanh_none)(a, b)]
    if k == "embed":
        return [tf.nn.embedding_lookup(variables["table"], tf.constant(IDS[node.param]))]
    if k == "table_mean":
        return [tf.reduce_mean(tf.convert_to_tensor(variables["table"]), axis=0)]
    if k == "random":
        a = args[0]
        if node.param == 0:
            return [a * tf.random.uniform(a.shape, 0.5, 1.5, dtype=dtype, seed=7)]
        return [tf.nn.dropout(a, rate=0.25, seed=11)]
    if k == "conv":
        image = tf.reshape(tf.broadcast_to(args[0], [N, N]), [1, N, N, 1])
        z = tf.nn.bias_add(tf.nn.conv2d(image, variables["filter"], 1, "SAME"),
                           variables["conv_bias"])
        z = [tf.nn.relu, tf.tanh, tf.identity][node.param](z)
        return [tf.reshape(tf.reduce_sum(z, axis=3), [N, N])]
    if k == "dense":
        z = tf.matmul(tf.broadcast_to(args[0], [N, N]), variables["w"])
        if node.param == 2:
            return [tf.nn.relu(z + variables["b"])]
        z = tf.nn.bias_add(z, variables["b"])
        return [tf.nn.relu(z) if node.param == 0 else z]
    raise AssertionError(k)


USER_KINDS = frozenset({"while", "cond", "custom", "embed", "table_mean", "random", "conv",
                        "dense"})


def _build_node(node: Node, values: list, dtype, variables: Optional[dict] = None) -> list:
    args = [values[i] for i in node.args]
    k = node.kind
    if k in USER_KINDS:
        return _build_user_node(node, args, dtype, variables)
    if k == "unary":
        return [_UNARY_FNS[node.fn](args[0])]
    if k == "stop":
        return [tf.stop_gradient(args[0])]
    if k == "binary":
        if node.fn == "add":
            return [args[0] + args[1]]
        if node.fn == "sub":
            return [args[0] - args[1]]
        if node.fn == "mul":
            return [args[0] * args[1]]
        if node.fn == "div_safe":
            return [args[0] / (1.5 + tf.tanh(args[1]))]
        full = [tf.broadcast_to(a, _broadcast_all([v.shape for v in args])) for a in args]
        return [tf.math.add_n(full)]
    if k == "matmul":
        a, b = (tf.broadcast_to(t, [N, N]) for t in args)
        return [tf.matmul(a, b, transpose_a=bool(node.param & 1), transpose_b=bool(node.param & 2))]
    if k == "split":
        a, b = (tf.broadcast_to(t, [N, N]) for t in args)
        return list(tf.split(tf.tanh(tf.concat([a, b], axis=node.param)), 2, axis=node.param))
    if k == "unstack":
        a, b = (tf.broadcast_to(t, [N, N]) for t in args)
        return list(tf.unstack(a * b + a, axis=node.param))
    if k == "reduce":
        return [_reduce(node.fn, args[0], node.param)]
    if k == "gather":
        indices = tf.constant([[2, 0, 2], [1, 1, 0], [0, 2, 1]][node.param], tf.int32)
        return [tf.gather(args[0], indices)]
    if k == "to_int":
        return [tf.cast(tf.round(args[0] * 3.0), tf.int32)]
    if k == "from_int":
        return [tf.cast(args[0], dtype) * args[1]]
    raise AssertionError(k)


def _broadcast_all(shapes):
    out = ()
    for s in shapes:
        out = _broadcast(out, tuple(s.as_list()))
    return list(out)


@dataclasses.dataclass
class Built:
    graph: tf.Graph
    placeholders: list
    values: list
    feed: dict
    variables: dict = dataclasses.field(default_factory=dict)


def build(program: Program) -> Built:
    graph = tf.Graph()
    dtype = tf.as_dtype(program.dtype)
    rng = np.random.RandomState(program.seed)
    with graph.as_default():
        placeholders = [tf.compat.v1.placeholder(dtype, shape, name=f"in{i}")
                        for i, shape in enumerate(program.inputs)]
        variables = make_variables(dtype, program.seed)
        values = list(placeholders)
        for node in program.nodes:
            values.extend(_build_node(node, values, dtype, variables))
    feed = {p: rng.uniform(-1.5, 1.5, size=p.shape.as_list()).astype(program.dtype)
            for p in placeholders}
    return Built(graph, placeholders, values, feed, variables)


def _xs(program: Program, values: list, variables: dict) -> list:
    return [values[i] for i in program.xs] + [variables[n] for n in program.var_xs]


def _every_float_value(program: Program, values: list) -> list:
    """A second checkpoint list: every float value the program made (not its inputs)."""
    return [v for v in values[len(program.inputs):] if v.dtype.is_floating]


@contextlib.contextmanager
def no_fallback(where: str):
    """Fails (Mismatch) if a gradients() call in the block fell back to tf.gradients."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        yield
    taken = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    if taken:
        raise Mismatch(f"{where}: the guard fell back to tf.gradients {len(taken)} time(s): "
                       f"{taken[0]}")


def grad_ys_for(program: Program, built: Built):
    grad_ys = []
    for y_index, seed in zip(program.ys, program.grad_ys):
        y = built.values[y_index]
        if seed is None:
            grad_ys.append(None)
        else:
            rng = np.random.RandomState(seed)
            grad_ys.append(tf.constant(rng.uniform(-2, 2, size=y.shape.as_list()), dtype=y.dtype))
    if all(g is None for g in grad_ys) and program.grad_ys and program.grad_ys[0] is None \
            and len(grad_ys) == 1:
        return None  # exercise the plain default too
    return grad_ys


class Mismatch(AssertionError):
    pass


def check_program(program: Program, strategies: Optional[list] = None) -> int:
    """Build, differentiate every way, run once and compare.  Returns how many
    ``gradients()`` variants were compared with TensorFlow."""
    if strategies is None:
        strategies = msg.available_strategies()
    built = build(program)
    with built.graph.as_default():
        ys = [built.values[i] for i in program.ys]
        xs = _xs(program, built.values, built.variables)
        checkpoints = [built.values[i] for i in program.checkpoints]
        for t in checkpoints:
            tf.compat.v1.add_to_collection("checkpoints", t)
        options = dict(
            stop_gradients=[built.values[i] for i in program.stop_gradients] or None,
            unconnected_gradients="zero" if program.unconnected_zero else "none",
        )
        grad_ys = grad_ys_for(program, built)
        expected = tf_gradients(ys, xs, grad_ys=grad_ys, **options)
        variants = {}
        region_ok = True
        lists = {"list": checkpoints, "every value": _every_float_value(program, built.values)}
        if not lists["every value"]:
            del lists["every value"]  # a program of integer values only
        with no_fallback(f"xs={program.xs}+{program.var_xs} ys={program.ys}"):
            for name, given in lists.items():
                try:
                    variants[name] = msg.gradients(ys, xs, grad_ys=grad_ys, checkpoints=given,
                                                   **options)
                except ValueError as error:
                    # An explicit list with nothing usable is an error by design.
                    if "can be used" not in str(error):
                        raise
                    region_ok = region_ok and name != "list"
            for name in strategies:
                variants[name] = msg.gradients(ys, xs, grad_ys=grad_ys, checkpoints=name,
                                               **options)
    fetches = {"tf": [g for g in expected if g is not None]}
    for name, grads in variants.items():
        fetches[name] = [g for g in grads if g is not None]
    with tf.compat.v1.Session(graph=built.graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        out = sess.run(fetches, feed_dict=built.feed)
    dtype = np.dtype(program.dtype)
    rtol = 1e-4 if dtype == np.float32 else 1e-9
    for name, grads in variants.items():
        where = f"{name}: xs={program.xs}+{program.var_xs} ys={program.ys}"
        if [kind(g) for g in grads] != [kind(g) for g in expected]:
            raise Mismatch(f"{where}: kinds {[kind(g) for g in grads]} != tf "
                           f"{[kind(g) for g in expected]}")
        for g, e in zip(grads, expected):
            if g is not None and g.dtype != e.dtype:
                raise Mismatch(f"{where}: dtype {g.dtype} != tf {e.dtype}")
        for i, (ours, theirs) in enumerate(zip(out[name], out["tf"])):
            ours, theirs = dense(ours), dense(theirs)
            if ours.shape != theirs.shape:
                raise Mismatch(f"{where}: gradient {i} shape {ours.shape} != tf {theirs.shape}")
            scale = float(np.max(np.abs(theirs[np.isfinite(theirs)]), initial=1.0))
            np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=rtol * scale,
                                       err_msg=where)
    # An explicit list that keeps nothing must have been rejected for that reason only.
    if not region_ok:
        assert not _any_usable(program, built), "usable checkpoints were rejected"
    return len(variants)


def check_program_in_function(program: Program, strategies: Optional[list] = None) -> int:
    """The same comparison inside a ``tf.function`` body (a FuncGraph, unhashable tensors)."""
    if strategies is None:
        strategies = msg.available_strategies()
    dtype = tf.as_dtype(program.dtype)
    rng = np.random.RandomState(program.seed)
    arrays = [rng.uniform(-1.5, 1.5, size=shape).astype(program.dtype) for shape in program.inputs]
    variables = make_variables(dtype, program.seed)

    @tf.function
    def run(*inputs):
        values = list(inputs)
        for node in program.nodes:
            values.extend(_build_node(node, values, dtype, variables))
        built = Built(None, list(inputs), values, {}, variables)
        ys = [values[i] for i in program.ys]
        xs = _xs(program, values, variables)
        checkpoints = [values[i] for i in program.checkpoints]
        options = dict(
            stop_gradients=[values[i] for i in program.stop_gradients] or None,
            unconnected_gradients="zero" if program.unconnected_zero else "none",
        )
        grad_ys = grad_ys_for(program, built)
        out = {"tf": tf_gradients(ys, xs, grad_ys=grad_ys, **options)}
        with no_fallback(f"in tf.function: xs={program.xs}+{program.var_xs} ys={program.ys}"):
            try:
                out["list"] = msg.gradients(ys, xs, grad_ys=grad_ys, checkpoints=checkpoints,
                                            **options)
            except ValueError as error:
                if "can be used" not in str(error):  # nothing usable: an error by design
                    raise
            for name in strategies:
                out[name] = msg.gradients(ys, xs, grad_ys=grad_ys, checkpoints=name, **options)
        return out

    out = run(*[tf.constant(a) for a in arrays])
    rtol = 1e-4 if program.dtype == "float32" else 1e-9
    expected = out.pop("tf")
    for name, grads in out.items():
        assert [kind(g) for g in grads] == [kind(g) for g in expected], name
        for ours, theirs in zip(grads, expected):
            if theirs is None:
                continue
            assert ours.dtype == theirs.dtype, name
            a, b = _dense_eager(ours), _dense_eager(theirs)
            scale = float(np.max(np.abs(b[np.isfinite(b)]), initial=1.0))
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale, err_msg=name)
    return len(out)


def _dense_eager(g):
    if isinstance(g, tf.IndexedSlices):
        return dense(types.SimpleNamespace(values=g.values.numpy(), indices=g.indices.numpy(),
                                            dense_shape=g.dense_shape.numpy()))
    return g.numpy()


def _any_usable(program: Program, built: Built) -> bool:
    from memory_saving_gradients import graph as graph_lib
    ys = [built.values[i] for i in program.ys]
    xs = [built.values[i] for i in program.xs] + [
        built.variables[n].handle for n in program.var_xs]
    region = graph_lib.forward_region(ys, xs)
    excluded = {t.ref() for t in ys + xs}
    return any(region.produces(built.values[i]) and built.values[i].ref() not in excluded
               for i in program.checkpoints)


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    logger = logging.getLogger("memory_saving_gradients")
    level = logger.level
    logger.setLevel(logging.ERROR)  # strategies that find nothing warn and fall back
    yield
    logger.setLevel(level)


EXAMPLES = int(os.environ.get("RANDOM_GRAPH_EXAMPLES", "250"))


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs())
def test_random_graphs_match_tf_gradients(program):
    check_program(program)


@pytest.mark.slow
@settings(max_examples=max(10, EXAMPLES // 10), deadline=None, derandomize=True,
          database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs(max_nodes=8))
def test_random_graphs_match_tf_gradients_in_tf_function(program):
    check_program_in_function(program)


def test_generator_covers_the_op_kinds():
    """The examples the suite runs reach every op kind, several ys, intermediate,
    integer and duplicate xs, grad_ys, stop_gradients and unconnected='zero'."""
    seen = set()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(programs())
    def collect(p):
        seen.update(n.kind for n in p.nodes)
        ints = _int_values(p)
        if len(set(p.ys)) > 1:
            seen.add("several ys")
        if any(i >= len(p.inputs) for i in p.xs):
            seen.add("intermediate x")
        if any(i in ints for i in p.xs):
            seen.add("integer x")
        if len(set(p.xs)) < len(p.xs):
            seen.add("duplicate xs")
        if set(p.xs) & set(p.ys):
            seen.add("x is a y")
        if any(g is not None for g in p.grad_ys):
            seen.add("grad_ys")
        if p.stop_gradients:
            seen.add("stop_gradients")
        if p.unconnected_zero:
            seen.add("zero")
        if p.var_xs:
            seen.add("variable x")
        if any(n.kind == "while" and n.param >= 4 for n in p.nodes):
            seen.add("TensorArray")

    collect()
    wanted = {"unary", "binary", "matmul", "split", "unstack", "reduce", "gather", "to_int",
              "from_int", "stop", "several ys", "intermediate x", "integer x", "duplicate xs",
              "x is a y", "grad_ys", "stop_gradients", "zero", "variable x", "TensorArray"}
    wanted |= USER_KINDS
    assert wanted <= seen, wanted - seen


def _int_values(program):
    shapes, is_int = list(program.inputs), [False] * len(program.inputs)
    for node in program.nodes:
        for shape, integer in _node_outputs(node, shapes, is_int):
            shapes.append(shape)
            is_int.append(integer)
    return {i for i, f in enumerate(is_int) if f}


def test_a_known_program():
    """A fixed mid-size program, so a broken build shows without hypothesis."""
    program = Program(
        dtype="float32", inputs=((N, N), (N,)),
        nodes=(Node("unary", "tanh", (0,)), Node("binary", "mul", (2, 1)),
               Node("matmul", "matmul", (3, 2), 2), Node("split", "split", (4, 3), 1),
               Node("reduce", "sum", (5,), 2), Node("binary", "add", (7, 6))),
        xs=(0, 1, 3), ys=(8, 5), grad_ys=(None, 7), checkpoints=(2, 4),
        stop_gradients=(), unconnected_zero=False, seed=3)
    assert check_program(program) == 2 + len(msg.available_strategies())

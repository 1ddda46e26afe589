"""The op-type sets of ``memory_saving_gradients/ops.py`` agree with each other and with
TensorFlow's op registry.

Each set names a property (recomputable or not, expensive, what the gradient
reads, aliases, shapes only); these tests check that every name is an op type
the installed TensorFlow registers, that the sets which must be disjoint are,
that the ones that must nest do, and that the op definitions have the inputs
and outputs each rule reads.  Milliseconds: no session, one tiny graph.
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
import tensorflow as tf

from memory_saving_gradients import _tensorflow as shim
from memory_saving_gradients import graph as graph_lib
from memory_saving_gradients import ops

pytestmark = pytest.mark.unit

GRADIENT_READS = {
    name: value for name, value in ops.ALL_SETS.items() if name.startswith("GRADIENT_READS_")
}
INTEGER_TYPES = {tf.int32.as_datatype_enum, tf.int64.as_datatype_enum}


def _output_types(op_def, attr_name):
    attr = next(a for a in op_def.attr if a.name == attr_name)
    return set(attr.allowed_values.list.type)


def test_all_sets_lists_every_set():
    module_sets = {name for name in dir(ops) if isinstance(getattr(ops, name), frozenset)}
    assert module_sets == set(ops.ALL_SETS) and len(ops.ALL_SETS) >= 15


@pytest.mark.parametrize("name", sorted(ops.ALL_SETS))
def test_every_name_is_a_registered_op_type(name):
    unknown = sorted(t for t in ops.ALL_SETS[name] if not shim.is_registered_op_type(t))
    assert not unknown, f"{name}: {unknown} not registered in TensorFlow {tf.__version__}"


def test_expensive_types_are_recomputable():
    assert ops.CONVOLUTIONS | ops.MATRIX_PRODUCTS <= ops.EXPENSIVE
    assert not ops.EXPENSIVE & ops.CONTROL_FLOW
    stateful = sorted(t for t in ops.EXPENSIVE if shim.op_def(t).is_stateful)
    assert not stateful


def test_control_flow_sets_nest():
    assert ops.V1_MERGES | ops.V1_SWITCHES <= ops.V1_CONTROL_FLOW <= ops.CONTROL_FLOW
    for name, value in GRADIENT_READS.items():
        assert not value & ops.CONTROL_FLOW, name


def test_gradient_read_sets_are_disjoint():
    for (a, first), (b, second) in itertools.combinations(sorted(GRADIENT_READS.items()), 2):
        assert not first & second, (a, b, sorted(first & second))


def test_shape_only_readers_read_no_values_and_give_integers():
    value_readers = set().union(*GRADIENT_READS.values()) | ops.ALIASES | ops.EXPENSIVE
    assert not ops.SHAPE_ONLY_READERS & value_readers
    for op_type in ops.SHAPE_ONLY_READERS:
        op_def = shim.op_def(op_type)
        for arg in op_def.output_arg:
            types = {arg.type} if arg.type else _output_types(op_def, arg.type_attr)
            assert types <= INTEGER_TYPES, (op_type, arg.name)


def test_aliases_have_one_output_and_their_gradient_reads_nothing():
    assert ops.ALIASES == (ops.VALUE_FORWARDING | ops.SAME_ELEMENTS | ops.VARIABLE_READS
                           | ops.LISTS_OF_SLICES | ops.CHECKS_OF_THEIR_INPUT)
    for op_type in ops.ALIASES:
        assert len(shim.op_def(op_type).output_arg) == 1, op_type
    # PreventGradient's gradient raises: it reads nothing, but is no gradient to list
    assert (ops.ALIASES - {"PreventGradient"}) <= ops.GRADIENT_READS_NOTHING
    assert not ops.ALIASES & ops.EXPENSIVE


def test_op_definitions_have_what_each_gradient_rule_reads():
    for op_type in ops.GRADIENT_READS_OTHER_INPUT:
        assert len(shim.op_def(op_type).input_arg) == 2, op_type
    for op_type in ops.GRADIENT_READS_SECOND_OUTPUT:
        assert len(shim.op_def(op_type).output_arg) >= 2, op_type
    for op_type in ops.GRADIENT_READS_TWO_INPUTS_AND_SAVED_OUTPUTS:
        op_def = shim.op_def(op_type)
        assert len(op_def.input_arg) >= 2 and len(op_def.output_arg) > 3, op_type


def test_kind_and_gather_types_have_registered_gradients():
    for op_type in ops.GRADIENT_PASSES_KIND | ops.GATHERS:
        assert shim.registered_gradient(op_type) is not None, op_type


@pytest.mark.parametrize("op_type", sorted(ops.GRADIENT_READS_SECOND_INPUT))
def test_rectifier_gradients_differentiated_again_read_only_the_features(op_type):
    """What TensorFlow's registered gradient of each such op reads of the op's inputs,
    found by building it: the features (input 1), never the incoming gradient."""
    graph = tf.Graph()
    with graph.as_default():
        dy = tf.compat.v1.placeholder(tf.float32, [4, 8], name="dy")
        features = tf.compat.v1.placeholder(tf.float32, [4, 8], name="features")
        rectifier = {"ReluGrad": tf.raw_ops.ReluGrad, "Relu6Grad": tf.raw_ops.Relu6Grad,
                     "LeakyReluGrad": tf.raw_ops.LeakyReluGrad}[op_type]
        out = rectifier(gradients=dy, features=features)
        before = set(graph.get_operations())
        tf.compat.v1.gradients(out, [dy, features], grad_ys=tf.ones([4, 8]))
        read = {t.ref() for op in graph.get_operations() if op not in before
                for t in op.inputs if t.op in before}
    assert out.op.type == op_type
    assert read == {features.ref()}, read
    assert graph_lib.gradient_reads(out.op) == ((features,), ())


def _forward_reads(grads, before: set) -> list:
    """``(op, tensor)``: what the gradient ops on a path to ``grads`` (those grappler
    keeps) read of the ops in ``before``."""
    needed, stack = set(), [g.op for g in grads]
    while stack:
        op = stack.pop()
        if op not in needed and op not in before:
            needed.add(op)
            stack.extend(t.op for t in op.inputs)
    return [(op, t) for op in needed for t in op.inputs if t.op in before]


@pytest.mark.parametrize("op_type", sorted(ops.GRADIENT_READS_DIVISOR))
@pytest.mark.parametrize("divisor_needs_gradient", [False, True])
def test_division_gradients_read_the_dividend_only_for_the_divisors(op_type, divisor_needs_gradient):
    """What the ops that compute TensorFlow's registered gradient of a division read of
    its inputs (those on a path to a wanted gradient: grappler prunes the others)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [4, 8], name="y")
        divide = {"RealDiv": tf.raw_ops.RealDiv, "Div": tf.raw_ops.Div,
                  "DivNoNan": tf.raw_ops.DivNoNan}[op_type]
        out = divide(x=x, y=y)
        before = set(graph.get_operations())
        wanted = [x, y] if divisor_needs_gradient else [x]
        grads = tf.compat.v1.gradients(out, wanted, grad_ys=tf.ones([4, 8]))
        read = {t.ref() for _, t in _forward_reads(grads, before) if t.op is not out.op}
    expected = {x.ref(), y.ref()} if divisor_needs_gradient else {y.ref()}
    assert read == expected
    found = graph_lib.gradient_reads(out.op, lambda t: t.ref() in {w.ref() for w in wanted})
    assert {t.ref() for t in found[0]} == expected and found[1] == ()


#: Ops of GRADIENT_READS_NOTHING beyond the elementwise and shape ones, built on x.
_REARRANGEMENTS = {
    "SpaceToBatchND": lambda x: tf.space_to_batch_nd(x, [2, 2], [[0, 0], [0, 0]]),
    "BatchToSpaceND": lambda x: tf.compat.v1.batch_to_space_nd(x, [2, 2], [[0, 0], [0, 0]]),
    "SpaceToDepth": lambda x: tf.nn.space_to_depth(x, 2),
    "DepthToSpace": lambda x: tf.nn.depth_to_space(x, 2),
    "PadV2": lambda x: tf.raw_ops.PadV2(input=x, paddings=[[0, 0], [1, 1], [1, 1], [0, 0]],
                                        constant_values=1.0),
    "MirrorPad": lambda x: tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="REFLECT"),
    "ReverseV2": lambda x: tf.reverse(x, [1]),
    "Roll": lambda x: tf.roll(x, 1, 1),
    "MatrixBandPart": lambda x: tf.linalg.band_part(x, 1, 1),
    "GatherNd": lambda x: tf.gather_nd(x, [[0, 1], [2, 3]]),
    "Cumsum": lambda x: tf.cumsum(x, 1),
    "ResizeNearestNeighbor": lambda x: tf.raw_ops.ResizeNearestNeighbor(images=x, size=[16, 16]),
    "AvgPool": lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID"),
}


@pytest.mark.parametrize("op_type", sorted(_REARRANGEMENTS))
def test_rearrangement_gradients_read_no_values(op_type):
    """TensorFlow's registered gradient of each reads no float tensor of the forward
    pass (shapes only, and integer arguments), as GRADIENT_READS_NOTHING says."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8, 8, 4], name="x")
        out = _REARRANGEMENTS[op_type](x)
        before = set(graph.get_operations())
        grads = tf.compat.v1.gradients(out, [x], grad_ys=tf.ones(out.shape))
        read = {t.name for op, t in _forward_reads(grads, before)
                if op.type not in ops.SHAPE_ONLY_READERS and t.dtype.is_floating}
    assert out.op.type == op_type and op_type in ops.GRADIENT_READS_NOTHING
    assert read == set(), read
    assert graph_lib.gradient_reads(out.op) == ((), ())


def test_gradient_reads_follows_the_sets():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.ones([2, 3])
        w = tf.ones([3, 4])
        labels = tf.ones([2, 3])
        product = tf.matmul(x, w)
        relu = tf.nn.relu(x)
        added = x + labels
        tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=x)
        pooled = tf.nn.max_pool2d(tf.ones([1, 4, 4, 1]), 2, 2, "VALID")
        other = tf.sin(x)
    assert graph_lib.gradient_reads(added.op) == ((), ())
    assert graph_lib.gradient_reads(relu.op) == ((), tuple(relu.op.outputs))
    xent = next(op for op in graph.get_operations()
                if op.type in ops.GRADIENT_READS_SECOND_OUTPUT)
    assert graph_lib.gradient_reads(xent) == ((), (xent.outputs[1],))
    assert graph_lib.gradient_reads(pooled.op) == (tuple(pooled.op.inputs), tuple(pooled.op.outputs))
    assert graph_lib.gradient_reads(product.op) == ((x, w), ())
    only_x_needs = graph_lib.gradient_reads(product.op, lambda t: t is x)
    assert only_x_needs == ((w,), ())
    assert graph_lib.gradient_reads(other.op) == (tuple(other.op.inputs), ())

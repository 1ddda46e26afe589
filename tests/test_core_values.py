"""gradients() returns what tf.compat.v1.gradients returns.

Every test builds a model, takes our checkpointed gradients and TensorFlow's
own on the same graph, fetches both in ONE Session.run and compares: same
list structure, None pattern, ``IndexedSlices`` where tf.gradients gives one,
dtypes, and values within float tolerance.  Each test also checks that the
rewrite really recomputed something (otherwise it would compare tf.gradients
with itself).
"""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import tensorflow as tf
from gradient_values import swish_holding_its_insides

import memory_saving_gradients as msg
from memory_saving_gradients import checkpointing
from test_models import chain, mlp, resnet

tf_gradients = tf.compat.v1.gradients


def new_ops(graph, before):
    return [op for op in graph.get_operations() if op.name not in before]


def recomputed(graph, before):
    """Ops the call created as copies of forward ops (scope ``.../recompute...``)."""
    return [op for op in new_ops(graph, before) if "recompute" in op.name]


def names(graph):
    return {op.name for op in graph.get_operations()}


# ----------------------------------------------------------------------------
# Models


def test_tanh_chain(graph, run_both, assert_grads_match):
    model = chain.build_tanh_chain(n=20, size=64)
    before = names(graph)
    ours = msg.gradients(model.loss, model.inputs, checkpoints=model.units[4::5])
    theirs = tf_gradients(model.loss, model.inputs)
    assert len(recomputed(graph, before)) >= 15
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


@pytest.mark.parametrize("dtype", [tf.complex64, tf.complex128])
def test_a_complex_chain(graph, run_both, assert_grads_match, dtype):
    """Complex activations and weights: the recomputed copies and their gradients (which
    conjugate) give tf.gradients' values, with a list and with 'memory'."""
    x = tf.compat.v1.placeholder(dtype, [16, 64])
    v = tf.Variable(tf.cast(tf.complex(tf.ones([64]) * 0.9, tf.ones([64]) * 0.1), dtype))
    h, acts = x, []
    for _ in range(6):
        h = tf.sin(h * v) * tf.cast(0.9, dtype)
        acts.append(h)
    loss = tf.reduce_sum(tf.math.real(h * tf.math.conj(h)))
    feed = {x: (np.linspace(-1, 1, 16 * 64).reshape(16, 64) * (0.3 + 0.2j)).astype(
        dtype.as_numpy_dtype)}
    theirs = tf_gradients(loss, [v, x])
    for checkpoints in (acts[1::2], "memory"):
        ours = msg.gradients(loss, [v, x], checkpoints=checkpoints)
        assert_grads_match(ours, theirs, *run_both(ours, theirs, feed))
    # The gradients' Conj of the constant scale folds to a constant: made to wait for a
    # step's recomputation, grappler merged it with another step's and the wait closed
    # a cycle (its passes then failed: "couldn't be sorted in topological order").
    scale_conjugates = [op for op in graph.get_operations() if op.type == "Conj"
                        and op.inputs[0].op.type == "Cast"
                        and op.inputs[0].op.inputs[0].op.type == "Const"]
    assert scale_conjugates and not any(op.control_inputs for op in scale_conjugates)


def test_a_custom_gradient_closure_reads_the_copies_of_what_it_holds(graph, run_both,
                                                                      assert_grads_match):
    """A ``tf.custom_gradient`` closure holds tensors made inside the function: the
    gradient of a recomputed copy reads their copies (an original it read stayed alive
    from the forward pass), and one made in an earlier segment or kept, the original.
    Checkpoints at every second layer's result, at tensors inside the functions (the
    sigmoid, which the closure reads, and the pre-activation), and 'memory': the values
    equal tf.gradients', and no gradient op reads an original sigmoid whose copy runs in
    its step."""
    rng = np.random.default_rng(0)
    x = tf.compat.v1.placeholder(tf.float64, [16, 32])
    ws, h, inner, pre = [], x, [], []
    for _ in range(8):
        ws.append(tf.Variable(rng.standard_normal((32, 32)) / 6))
        pre.append(h @ ws[-1])
        h = swish_holding_its_insides(pre[-1])
        inner.append(h.op.inputs[0].op.inputs[1])  # the sigmoid (y = x * s)
    loss = tf.reduce_sum(h * h)
    feed = {x: rng.standard_normal((16, 32))}
    theirs = tf_gradients(loss, ws + [x])
    sigmoids = {t.op for t in inner}
    assert all(op.type == "Sigmoid" for op in sigmoids)
    for checkpoints in ([inner[2], inner[5], pre[1], pre[4]], "memory"):
        before = names(graph)
        ours = msg.gradients(loss, ws + [x], checkpoints=checkpoints)
        copies = recomputed(graph, before)
        copied = {op.name.rsplit("/", 1)[-1] for op in copies if op.type == "Sigmoid"}
        assert copied
        gradient_ops = [op for op in new_ops(graph, before) if "backprop_" in op.name]
        readers = [op.name for op in gradient_ops
                   for t in op.inputs if t.op in sigmoids and t.op.name in copied]
        assert not readers, readers
        assert_grads_match(ours, theirs, *run_both(ours, theirs, feed))


def test_a_gradient_op_of_a_constant_too_large_to_fold_still_waits(graph):
    """Grappler folds no constant over 10 MiB, so a gradient op that reads only such a
    constant (the Conj of a large complex scale) still runs when it is free to: it waits
    for its step's recomputation where the memory model has no room for it early, as any
    gradient op that reads nothing recomputed, while a small scale's Conj (folded) never
    waits (test_a_complex_chain)."""
    side = 1200  # complex64: 11.0 MiB
    x = tf.compat.v1.placeholder(tf.complex64, [side, side])
    scale = tf.cast(tf.constant(np.full((side, side), 0.9, np.float32)), tf.complex64)
    h, acts = x, []
    for _ in range(4):
        h = tf.sin(h) * scale
        acts.append(h)
    loss = tf.reduce_sum(tf.math.real(h * tf.math.conj(h)))
    msg.gradients(loss, [x], checkpoints=acts[1::2])
    waiting = [op for op in graph.get_operations() if op.type == "Conj"
               and op.inputs[0] is scale and "backprop" in op.name]
    assert waiting and any(op.control_inputs for op in waiting), [
        (op.name, op.control_inputs) for op in waiting]


def test_mlp_wrt_variables(graph, run_both, assert_grads_match):
    model = mlp.build(depth=6, width=32, batch=8)
    before = names(graph)
    ours = msg.gradients(model.loss, model.params, checkpoints=model.units[1::2])
    theirs = tf_gradients(model.loss, model.params)
    assert {op.type for op in recomputed(graph, before)} >= {"MatMul", "Relu"}
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def test_conv_net_with_batch_norm_in_training_mode(graph, run_both, assert_grads_match):
    """CIFAR ResNet v2 (8 layers): conv, FusedBatchNormV3 with batch statistics, relu, residual adds."""
    model = resnet.build(depth=8, batch=2, width=4, image_size=8)
    assert any(op.type == "FusedBatchNormV3" and op.get_attr("is_training")
               for op in graph.get_operations())
    before = names(graph)
    ours = msg.gradients(model.loss, model.params, checkpoints=model.units[:2])
    theirs = tf_gradients(model.loss, model.params)
    copied_types = {op.type for op in recomputed(graph, before)}
    assert {"Conv2D", "FusedBatchNormV3", "Relu", "AddV2"} <= copied_types, copied_types
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def test_residual_blocks(graph, run_both, assert_grads_match):
    model = chain.build_small_residual(n=6, size=64)
    before = names(graph)
    ours = msg.gradients(model.loss, model.inputs, checkpoints=model.units[1::2])
    theirs = tf_gradients(model.loss, model.inputs)
    assert recomputed(graph, before)
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def test_dropout_mask_is_reused_not_redrawn(graph, run_both, assert_grads_match):
    """tf.nn.dropout without any seed, inside a recomputed segment.

    The random op is stateful, so it must not be copied: the recomputed
    segment reads the mask drawn in the forward pass.  A forward-only step
    (fetching just the loss) between training steps draws an extra mask; a
    copied random op would then be out of step with the original.  Our
    gradients and tf.gradients are fetched in the same run, so they must
    see the same mask and agree exactly (up to float tolerance).
    """
    assert graph.seed is None
    rng = np.random.RandomState(0)
    x = tf.compat.v1.placeholder(tf.float32, [8, 16], name="x")
    w1 = tf.Variable(rng.randn(16, 32).astype(np.float32) * 0.3, name="w1")
    w2 = tf.Variable(rng.randn(32, 32).astype(np.float32) * 0.3, name="w2")
    w3 = tf.Variable(rng.randn(32, 4).astype(np.float32) * 0.3, name="w3")
    h1 = tf.tanh(tf.matmul(x, w1))
    dropped = tf.nn.dropout(h1, rate=0.5)
    h2 = tf.tanh(tf.matmul(dropped, w2))
    h3 = tf.tanh(tf.matmul(h2, w3))
    loss = tf.reduce_sum(h3 * h3)
    params = [w1, w2, w3]
    random_ops_before = [op for op in graph.get_operations() if op.op_def.is_stateful
                         and op.type.startswith("Random")]
    assert random_ops_before
    before = names(graph)
    ours = msg.gradients(loss, params, checkpoints=[h1, h3])
    theirs = tf_gradients(loss, params)
    copies = recomputed(graph, before)
    assert {"MatMul", "Tanh"} <= {op.type for op in copies}
    assert not [op for op in copies if op.op_def.is_stateful], "a stateful op was copied"
    assert any(op.type == "Mul" and "dropout" in op.name for op in copies), \
        "the dropout mask is not applied inside a recomputed segment; the test would prove nothing"

    feed = {x: rng.randn(8, 16).astype(np.float32)}
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        first = run_both(ours, theirs, feed, session=sess)
        sess.run(loss, feed)  # forward-only step: draws a mask nobody differentiates
        second = run_both(ours, theirs, feed, session=sess)
    assert_grads_match(ours, theirs, *first)
    assert_grads_match(ours, theirs, *second)
    # Different masks in the two steps, or the test above would not be sensitive.
    assert not np.allclose(first[1][0], second[1][0])


@pytest.mark.parametrize("pool", [tf.nn.fractional_max_pool, tf.nn.fractional_avg_pool])
def test_a_random_op_registered_stateless_is_kept_not_recomputed(
        graph, run_both, assert_grads_match, pool):
    """``FractionalMaxPool``/``FractionalAvgPool`` are registered stateless, but with the
    default seed 0 each kernel draws its own pooling regions. Recomputed, the copy pooled
    other regions than the forward op: gradients 20-60% off, with no warning. An op that
    declares ``seed`` and ``seed2`` attributes is kept, never copied."""
    rng = np.random.RandomState(1)
    x = tf.constant(rng.randn(4, 16, 16, 4).astype(np.float32))
    weights = [tf.Variable(rng.randn(3, 3, 4, 4).astype(np.float32) / 6) for _ in range(4)]
    h = x
    for i, w in enumerate(weights):
        h = tf.nn.relu(tf.nn.conv2d(h, w, 1, "SAME"))
        if i == 1:
            before_pool = h
            h = pool(h, [1.0, 1.44, 1.73, 1.0])[0] * 1.0
    loss = tf.reduce_sum(tf.square(h))
    pool_op = next(op for op in graph.get_operations() if op.type.startswith("Fractional"))
    assert not pool_op.op_def.is_stateful  # what made it look safe to copy
    before = names(graph)
    ours = msg.gradients(loss, weights, checkpoints=[before_pool])  # its segment recomputed
    theirs = tf_gradients(loss, weights)
    copies = recomputed(graph, before)
    assert {"Conv2D", "Relu"} <= {op.type for op in copies}, "nothing recomputed near the pool"
    assert not [op for op in copies if op.type == pool_op.type], "the random pool was copied"
    assert_grads_match(ours, theirs, *run_both(ours, theirs, {}))


@pytest.mark.parametrize("stateful", [False, True], ids=["stateless", "stateful"])
def test_a_stateless_numpy_function_recomputed_is_said(graph, run_both, assert_grads_match,
                                                         caplog, stateful):
    """``tf.numpy_function(f, ..., stateful=False)`` is registered stateless, so it is
    recomputed and ``f`` runs again in the backward pass; a helper's trial drew a random
    mask in one and got gradients 24-143% off, with nothing said.  Recomputed, it is said
    once per graph at WARNING with what to do; declared stateful it is kept, said
    nothing, and the gradients equal plain's.  (A deterministic one here: both equal.)"""
    rng = np.random.RandomState(2)
    x = tf.constant(rng.randn(8, 16).astype(np.float32))
    weights = [tf.Variable(rng.randn(16, 16).astype(np.float32) / 4) for _ in range(4)]
    h = x
    for i, w in enumerate(weights):
        h = tf.tanh(tf.matmul(h, w))
        if i == 0:
            first = h
        if i == 1:
            scale = tf.numpy_function(lambda a: (np.abs(a) > 0.1).astype(np.float32), [h],
                                      tf.float32, stateful=stateful)
            h = h * tf.reshape(scale, [8, 16])
    loss = tf.reduce_sum(tf.square(h))
    before = names(graph)
    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        ours = msg.gradients(loss, weights, checkpoints=[first])
        msg.gradients(loss, weights, checkpoints=[first])  # once per graph
    said = [r.getMessage() for r in caplog.records if "numpy_function" in r.getMessage()]
    copies = {op.type for op in recomputed(graph, before)}
    assert ("PyFuncStateless" in copies) == (not stateful), copies
    assert len(said) == (0 if stateful else 1), said
    if said:
        assert "stateful=True" in said[0] and "random" in said[0], said
    theirs = tf_gradients(loss, weights)
    assert_grads_match(ours, theirs, *run_both(ours, theirs, {}))


def test_a_py_function_is_said_to_hold_what_the_model_does_not_see(graph):
    """The tensors a ``tf.py_function``'s Python code makes, and the eager tape TensorFlow
    keeps from each call for its gradient, are outside the graph: in a helper's trial
    three calls measured 5-6.5 MiB above both planned peaks, with empty assumptions.
    The plan says so where the forward pass calls one, and only there."""
    x = tf.constant(np.ones((8, 16), np.float32))
    w = tf.Variable(np.ones((16, 16), np.float32) / 16)
    h = tf.tanh(tf.matmul(x, w))
    plain_loss = tf.reduce_sum(tf.tanh(tf.matmul(h, w)))
    assert not [a for a in msg.plan(plain_loss, [w], checkpoints=[h]).assumptions
                if "py_function" in a]
    called = tf.py_function(lambda a: tf.sin(a), [h], tf.float32)
    called.set_shape(h.shape)
    loss = tf.reduce_sum(tf.tanh(tf.matmul(called, w)))
    notes = [a for a in msg.plan(loss, [w], checkpoints=[h]).assumptions if "py_function" in a]
    assert len(notes) == 1 and "1 tf.py_function call(s)" in notes[0], notes
    assert "peak_memory_during" in notes[0], notes


def test_embedding_gradient_stays_sparse(graph, run_both, assert_grads_match):
    """tf.gather on a resource variable: the gradient is IndexedSlices, like tf.gradients'.

    The table is looked up twice, on both sides of a checkpoint, so the two
    sparse contributions come from different segments and are summed by the
    rewrite, not by tf.gradients: the sum must stay an IndexedSlices.
    """
    rng = np.random.RandomState(1)
    table = tf.Variable(rng.randn(50, 8).astype(np.float32), name="table")
    w = tf.Variable(rng.randn(8, 8).astype(np.float32) * 0.5, name="w")
    ids = tf.compat.v1.placeholder(tf.int32, [6], name="ids")
    ids2 = tf.compat.v1.placeholder(tf.int32, [6], name="ids2")
    assert "Resource" in type(table).__name__ or table.handle.dtype == tf.resource
    h1 = tf.tanh(tf.matmul(tf.gather(table, ids), w))
    h2 = tf.tanh(h1)
    h3 = tf.tanh(tf.matmul(h2, w) + tf.gather(table, ids2))
    loss = tf.reduce_sum(tf.tanh(h3) ** 2)
    before = names(graph)
    ours = msg.gradients(loss, [table, w], checkpoints=[h2])
    theirs = tf_gradients(loss, [table, w])
    assert recomputed(graph, before)
    assert isinstance(theirs[0], tf.IndexedSlices)
    assert isinstance(ours[0], tf.IndexedSlices), type(ours[0])
    feed = {ids: [1, 3, 3, 7, 49, 0], ids2: [3, 3, 2, 9, 1, 1]}
    values = run_both(ours, theirs, feed)
    assert_grads_match(ours, theirs, *values)
    assert values[0][0].values.shape[0] == 12  # both lookups, not densified


def test_several_ys_with_grad_ys(graph, run_both, assert_grads_match):
    model = chain.build_tanh_chain(n=8, size=32)
    a = model.units
    ys = [a[2], a[7] * 2.0, tf.reduce_sum(a[5])]
    g0 = tf.compat.v1.placeholder(tf.float32, [32], name="g0")
    g1 = tf.compat.v1.placeholder(tf.float32, [32], name="g1")
    grad_ys = [g0, g1, tf.constant(3.0)]
    before = names(graph)
    ours = msg.gradients(ys, model.inputs, grad_ys=grad_ys, checkpoints=[a[1], a[4]])
    theirs = tf_gradients(ys, model.inputs, grad_ys=grad_ys)
    assert recomputed(graph, before)
    rng = np.random.RandomState(2)
    feed = dict(model.feed_dict)
    feed[g0] = rng.randn(32).astype(np.float32)
    feed[g1] = rng.randn(32).astype(np.float32)
    assert_grads_match(ours, theirs, *run_both(ours, theirs, feed))


def test_several_ys_some_grad_ys_none(graph, run_both, assert_grads_match):
    model = chain.build_tanh_chain(n=6, size=32)
    a = model.units
    ys = [tf.reduce_sum(a[2]), tf.reduce_sum(a[5])]
    ours = msg.gradients(ys, model.inputs, grad_ys=[None, tf.constant(-2.0)],
                         checkpoints=[a[3]])
    theirs = tf_gradients(ys, model.inputs, grad_ys=[None, tf.constant(-2.0)])
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def _bypass_model():
    """x -> a1 .. a6 (tanh), plus a bypass sum(a1 * a1): two paths from x to y."""
    model = chain.build_tanh_chain(n=6, size=32)
    a = model.units
    y = tf.reduce_sum(a[5]) + tf.reduce_sum(a[0] * a[0])
    return model, a, y


def test_stop_gradients(graph, run_both, assert_grads_match):
    model, a, y = _bypass_model()
    x = model.inputs[0]
    xs = [x, a[2]]
    before = names(graph)
    ours = msg.gradients(y, xs, checkpoints=[a[1], a[3]], stop_gradients=[a[2]])
    theirs = tf_gradients(y, xs, stop_gradients=[a[2]])
    assert recomputed(graph, before)
    values = run_both(ours, theirs, model.feed_dict)
    assert_grads_match(ours, theirs, *values)
    # The stop really cut the main path: only the bypass reaches x.
    full = run_both([tf_gradients(y, x)[0]], [tf_gradients(y, x)[0]], model.feed_dict)[0][0]
    assert not np.allclose(values[0][0], full)


def test_stop_gradients_single_tensor_and_on_a_checkpoint(graph, run_both, assert_grads_match):
    model, a, y = _bypass_model()
    x = model.inputs[0]
    ours = msg.gradients(y, x, checkpoints=[a[1], a[3]], stop_gradients=a[3])
    theirs = tf_gradients(y, x, stop_gradients=a[3])
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


# ----------------------------------------------------------------------------
# Keywords of tf.compat.v1.gradients


@pytest.mark.unit
def test_signature_has_every_keyword_of_tf_gradients_with_its_default():
    ours = inspect.signature(msg.gradients).parameters
    for name, param in inspect.signature(tf_gradients).parameters.items():
        assert name in ours, f"gradients() lacks keyword {name!r} of tf.compat.v1.gradients"
        assert ours[name].default == param.default, name
    ours_collection = inspect.signature(msg.gradients_collection).parameters
    assert "grad_ys" in ours_collection


def test_name_scopes_every_new_op(graph, run_both, assert_grads_match):
    model = mlp.build(depth=4, width=16, batch=4)
    before = names(graph)
    ours = msg.gradients(model.loss, model.params, checkpoints=model.units[1:2], name="my_grads")
    created = new_ops(graph, before)
    assert created and recomputed(graph, before)
    outside = [op.name for op in created if not op.name.startswith("my_grads")]
    assert not outside, outside[:5]
    theirs = tf_gradients(model.loss, model.params)
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def _colocated_new_ops(graph, before):
    """New non-copy ops that carry a colocation constraint (``_class`` attr)."""
    found = []
    for op in new_ops(graph, before):
        if "recompute" in op.name:
            continue
        try:
            if op.get_attr("_class"):
                found.append(op)
        except ValueError:
            pass
    return found


@pytest.mark.parametrize("colocate", [False, True])
def test_colocate_gradients_with_ops(graph, run_both, assert_grads_match, colocate):
    model = mlp.build(depth=4, width=16, batch=4)
    before = names(graph)
    ours = msg.gradients(model.loss, model.params, checkpoints=model.units[1:3],
                         colocate_gradients_with_ops=colocate)
    ours_colocated = _colocated_new_ops(graph, before)
    before_theirs = names(graph)
    theirs = tf_gradients(model.loss, model.params, colocate_gradients_with_ops=colocate)
    theirs_colocated = _colocated_new_ops(graph, before_theirs)
    assert bool(ours_colocated) == bool(theirs_colocated) == colocate
    if colocate:
        # Gradient ops of the copies colocate with the copies (same device as the originals).
        assert any(b"recompute" in group for op in ours_colocated for group in op.get_attr("_class"))
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


@pytest.mark.parametrize("gate", [False, True])
def test_gate_gradients(graph, run_both, assert_grads_match, gate):
    model = mlp.build(depth=4, width=16, batch=4)

    def gated(before):
        return [op for op in new_ops(graph, before) if "tuple/control_dependency" in op.name]

    before = names(graph)
    ours = msg.gradients(model.loss, model.params, checkpoints=model.units[1:3],
                         gate_gradients=gate)
    ours_gated = gated(before)
    before = names(graph)
    theirs = tf_gradients(model.loss, model.params, gate_gradients=gate)
    assert bool(ours_gated) == bool(gated(before)) == gate
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def max_add_n_fan_in(ops):
    return max((len(op.inputs) for op in ops if op.type == "AddN"), default=0)


AGGREGATIONS = [
    None,
    tf.AggregationMethod.ADD_N,
    tf.AggregationMethod.DEFAULT,
    tf.AggregationMethod.EXPERIMENTAL_TREE,
    tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N,
]


@pytest.mark.parametrize("method", AGGREGATIONS)
def test_aggregation_method(graph, run_both, assert_grads_match, method):
    """x feeds three consumers in one segment and two more in other segments.

    Gradient sums are built as tf.gradients builds them for the method: the
    tree methods add two gradients at a time (AddN of 2 inputs), so that
    each contribution can be freed as soon as it is added; ADD_N / DEFAULT
    add all at once.  The sums across segments must follow the method too.
    """
    x = tf.compat.v1.placeholder(tf.float32, [16], name="x")
    a1 = tf.tanh(x) + tf.sin(x) + x * x
    a2 = tf.tanh(a1)
    a3 = tf.tanh(a2) + tf.cos(x)
    a4 = tf.tanh(a3) * x
    y = tf.reduce_sum(a4)
    before = names(graph)
    ours = msg.gradients(y, x, checkpoints=[a1, a3], aggregation_method=method)
    ours_fan_in = max_add_n_fan_in(new_ops(graph, before))
    before = names(graph)
    theirs = tf_gradients(y, x, aggregation_method=method)
    theirs_fan_in = max_add_n_fan_in(new_ops(graph, before))
    tree = method in (tf.AggregationMethod.EXPERIMENTAL_TREE,
                      tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N)
    # x has 6 consumers; ours sums within segments and then across them.
    assert theirs_fan_in == (2 if tree else 6)
    assert (ours_fan_in == 2) if tree else (ours_fan_in >= 2), (method, ours_fan_in)
    feed = {x: np.linspace(-1, 1, 16).astype(np.float32)}
    assert_grads_match(ours, theirs, *run_both(ours, theirs, feed))


@pytest.mark.parametrize("unconnected", ["zero", tf.UnconnectedGradients.ZERO])
def test_unconnected_gradients_zero(graph, run_both, assert_grads_match, unconnected):
    model = chain.build_tanh_chain(n=6, size=32)
    a = model.units
    lonely = tf.compat.v1.placeholder(tf.float32, [3, 2], name="lonely")
    lonely_var = tf.Variable(tf.ones([5]), name="lonely_var")
    xs = [model.inputs[0], lonely, lonely_var, a[1]]
    ours = msg.gradients(model.loss, xs, checkpoints=[a[3]], unconnected_gradients=unconnected)
    theirs = tf_gradients(model.loss, xs, unconnected_gradients=unconnected)
    assert all(g is not None for g in ours)
    feed = dict(model.feed_dict)
    feed[lonely] = np.ones([3, 2], np.float32)
    values = run_both(ours, theirs, feed)
    assert_grads_match(ours, theirs, *values)
    assert values[0][1].shape == (3, 2) and not values[0][1].any()
    assert values[0][2].shape == (5,) and not values[0][2].any()


@pytest.mark.parametrize("unconnected", [None, "none", tf.UnconnectedGradients.NONE])
def test_none_pattern_same_as_tf(graph, run_both, assert_grads_match, unconnected):
    """None for unconnected xs, xs reached only through a stop, and xs after ys."""
    model, a, y = _bypass_model()
    x = model.inputs[0]
    lonely = tf.compat.v1.placeholder(tf.float32, [2], name="lonely")
    after = tf.tanh(y)  # downstream of y: not connected to it
    stopped = tf.compat.v1.placeholder(tf.float32, [32], name="stopped")
    y2 = y + tf.reduce_sum(tf.stop_gradient(stopped))
    xs = [lonely, x, after, stopped, a[3]]
    kwargs = {} if unconnected is None else {"unconnected_gradients": unconnected}
    ours = msg.gradients(y2, xs, checkpoints=[a[1], a[4]], **kwargs)
    theirs = tf_gradients(y2, xs, **kwargs)
    assert [g is None for g in theirs] == [True, False, True, True, False]
    feed = dict(model.feed_dict)
    feed[stopped] = np.zeros(32, np.float32)
    assert_grads_match(ours, theirs, *run_both(ours, theirs, feed))


# ----------------------------------------------------------------------------
# Kinds of xs, graph kinds, collections


def test_xs_placeholders_variables_and_intermediate_tensors(graph, run_both, assert_grads_match):
    model = mlp.build(depth=6, width=16, batch=4)
    h = model.units
    x = model.inputs[0]
    later_params = model.params[6:]  # layers 4.. and the output layer
    xs = [x, h[2]] + later_params + model.params[:2]
    before = names(graph)
    ours = msg.gradients(model.loss, xs, checkpoints=[h[1], h[4]])
    theirs = tf_gradients(model.loss, xs)
    assert recomputed(graph, before)
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def test_single_tensor_arguments(graph, run_both, assert_grads_match):
    model = chain.build_tanh_chain(n=6, size=32)
    ours = msg.gradients(model.loss, model.inputs[0], grad_ys=tf.constant(2.0),
                         checkpoints=model.units[2])
    theirs = tf_gradients(model.loss, model.inputs[0], grad_ys=tf.constant(2.0))
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def test_inside_tf_function():
    """In a FuncGraph tensors are unhashable; variables are captured from eager."""
    assert tf.executing_eagerly()
    params = mlp.make_params(seed=3, depth=4, width=16, batch=4)
    x_value, labels_value = mlp.make_inputs(seed=3, depth=4, width=16, batch=4)

    @tf.function
    def both(x, labels):
        loss, units = mlp.forward(params, x, labels)
        ours = msg.gradients(loss, params.trainable, checkpoints=units[1::2])
        theirs = tf_gradients(loss, params.trainable)
        return ours, theirs

    ours, theirs = both(tf.constant(x_value), tf.constant(labels_value))
    assert len(ours) == len(theirs) == len(params.trainable)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    func_graph = both.get_concrete_function(
        tf.constant(x_value), tf.constant(labels_value)).graph
    assert any("recompute" in op.name and op.type == "MatMul"
               for op in func_graph.get_operations())


def test_inside_tf_function_with_tensor_xs_and_collection_strategy():
    @tf.function
    def both(x):
        units = []
        a = x
        for _ in range(6):
            a = tf.tanh(a)
            units.append(a)
        tf.compat.v1.add_to_collection("checkpoints", units[2])
        loss = tf.reduce_sum(a)
        ours = msg.gradients(loss, [x, units[1]], checkpoints="collection")
        theirs = tf_gradients(loss, [x, units[1]])
        return ours, theirs

    ours, theirs = both(tf.linspace(-1.0, 1.0, 10))
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_collection_checkpoints_and_gradients_collection(graph, run_both, assert_grads_match):
    model = mlp.build(depth=6, width=16, batch=4, add_to_collection=True)
    assert len(tf.compat.v1.get_collection("checkpoints")) == 6
    before = names(graph)
    by_name = msg.gradients(model.loss, model.params)  # default: checkpoints='collection'
    assert recomputed(graph, before)
    before = names(graph)
    by_function = msg.gradients_collection(model.loss, model.params)
    assert recomputed(graph, before)
    theirs = tf_gradients(model.loss, model.params)
    assert_grads_match(by_name, theirs, *run_both(by_name, theirs, model.feed_dict))
    assert_grads_match(by_function, theirs, *run_both(by_function, theirs, model.feed_dict))


def test_gradients_collection_replacing_tf_gradients(graph, run_both, assert_grads_match, monkeypatch):
    """The README's one-line patch: tf.gradients now checkpoints, and still gives tf's values."""
    model = chain.build_tanh_chain(n=10, size=32, add_to_collection=True)
    monkeypatch.setitem(tf.__dict__, "gradients", msg.gradients_collection)
    before = names(graph)
    ours = tf.gradients(model.loss, model.inputs)
    assert recomputed(graph, before)
    monkeypatch.undo()
    theirs = tf_gradients(model.loss, model.inputs)
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def test_empty_collection_falls_back_to_tf_gradients(graph, run_both, assert_grads_match):
    model = chain.build_tanh_chain(n=5, size=16)
    before = names(graph)
    ours = msg.gradients_collection(model.loss, model.inputs)
    assert not recomputed(graph, before)
    theirs = tf_gradients(model.loss, model.inputs)
    assert_grads_match(ours, theirs, *run_both(ours, theirs, model.feed_dict))


def test_choose_checkpoints_drops_unusable_tensors(graph):
    """xs, ys and tensors not between them are dropped from a list; the rest sorted."""
    model, a, y = _bypass_model()
    x = model.inputs[0]
    outside = tf.tanh(tf.constant(1.0))
    region = msg.graph.forward_region([y], [x])
    chosen = checkpointing.choose_checkpoints([a[4], x, y, outside, a[1], a[4]], [y], [x],
                                              region, graph)
    assert [t.name for t in chosen] == [a[1].name, a[4].name]

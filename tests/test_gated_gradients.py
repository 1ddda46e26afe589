"""A recomputed op's input gradients are released together when some of them read a
recomputed tensor and some do not (rewrite.gated_gradients).

Without the gate the executor runs ahead on whichever gradient of an op is
ready first.  On the U-Net the slices of a concat's gradient then ran while
the convolution's filter gradient still held the recomputed concat: 'memory'
measured 27.4 MB in some runs and 35.1 MB in most, where plan() predicts
27.4 (tests/test_strategies.py measures it).  The gate is control inputs only;
values are unchanged.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from memory_saving_gradients import rewrite


def _product_graph():
    rng = np.random.RandomState(0)
    u = tf.constant(rng.randn(8, 16).astype(np.float32))
    w = tf.Variable(rng.randn(16, 16).astype(np.float32) * 0.1)
    x = tf.tanh(u * 2.0)
    y = tf.matmul(x, w)
    return u, w, x, y, tf.reduce_sum(tf.tanh(y))


def test_consumers_of_one_gradient_wait_for_the_others():
    with tf.Graph().as_default():
        u, w, x, y, loss = _product_graph()
        plain = tf.compat.v1.gradients(loss, [u, w])
        with rewrite.gated_gradients([x.op, y.op]):
            gated = tf.compat.v1.gradients(loss, [u, w])
        # MatMul's gradient: two products, the one for w reads the recomputed x, the one
        # for x does not; the TanhGrad below x reads the one for x
        tanh_grad = gated[0].op.inputs[0].op
        assert tanh_grad.type == "TanhGrad", tanh_grad.type
        gradient_of_w = gated[1].op
        assert gradient_of_w.type == "MatMul"
        assert gradient_of_w in tanh_grad.control_inputs
        # nothing is left behind on the op, and the first call was not gated
        assert y.op._gradient_function is None
        assert not plain[0].op.inputs[0].op.control_inputs
        _assert_same_values(plain, gated)


def test_gradients_that_all_read_recomputed_tensors_are_not_gated():
    """x * z with both recomputed: each gradient holds a recomputed tensor, waiting
    frees nothing (on the transformer's GELU, gating such products raised the peak
    from 29.3 to 31.1 MB)."""
    with tf.Graph().as_default() as graph:
        u, w, x, y, _ = _product_graph()
        z = tf.tanh(y)
        product = x * z
        loss = tf.reduce_sum(tf.tanh(product))
        with rewrite.gated_gradients([x.op, y.op, z.op, product.op]):
            tf.compat.v1.gradients(loss, [u, w])
        ops = graph.get_operations()
        of_product = {op for op in ops if f"/{product.op.name}_grad/" in op.name}
        assert {op.type for op in of_product} >= {"Mul"}, of_product
        waits = [op.name for op in ops if of_product & set(op.control_inputs)]
        assert not waits, waits
        # the MatMul below it still is gated (one of its gradients reads x, one not)
        assert any(op.control_inputs for op in ops if op.name.startswith("gradients/"))


def test_an_error_inside_leaves_the_op_as_it_was():
    with tf.Graph().as_default():
        _, _, _, y, _ = _product_graph()
        try:
            with rewrite.gated_gradients([y.op]):
                raise RuntimeError("inside")
        except RuntimeError:
            pass
        assert y.op._gradient_function is None


def _two_products_graph():
    """u -> tanh -> x @ w1 -> tanh -> z @ w2 -> loss: two products of a recomputed tensor
    and a weight; the backward pass differentiates the second (q) first."""
    rng = np.random.RandomState(1)
    u = tf.constant(rng.randn(8, 16).astype(np.float32))
    w1 = tf.Variable(rng.randn(16, 16).astype(np.float32) * 0.1)
    w2 = tf.Variable(rng.randn(16, 16).astype(np.float32) * 0.1)
    x = tf.tanh(u)
    y = tf.matmul(x, w1)
    z = tf.tanh(y)
    q = tf.matmul(z, w2)
    return u, (w1, w2), (x, y, z, q), tf.reduce_sum(tf.tanh(q))


def test_a_late_copy_waits_before_the_ops_built_on_its_pairs_gradients():
    with tf.Graph().as_default():
        u, weights, (x, y, z, q), loss = _two_products_graph()
        plain = tf.compat.v1.gradients(loss, [u, *weights])
        gates = rewrite.GradientGates()
        with gates.recording([x.op, y.op, z.op, q.op], late=[q.op]):
            late = tf.compat.v1.gradients(loss, [u, *weights])
        # before finish(): q's gradients do not wait for each other
        assert late[2].op.inputs[0].op is z.op  # the MatMul for w2 reads z
        z_grad = _tanh_grads_of(z, "gradients_1/")
        assert len(z_grad) == 1 and not z_grad[0].control_inputs, z_grad
        gates.finish({q.op: y.op})
        # after: the ops built on y's gradients (the TanhGrad below x) wait for both of
        # q's gradient ops; the TanhGrad below z (built on q's) still waits for nothing
        of_q = {late[2].op, z_grad[0].inputs[1].op}
        x_grad = late[0].op  # the gradient of u = tanh's input
        assert x_grad.type == "TanhGrad"
        assert of_q <= set(x_grad.control_inputs), (x_grad.control_inputs, of_q)
        assert not z_grad[0].control_inputs
        _assert_same_values(plain, late)


def test_a_late_copy_without_a_pair_waits_on_its_own_gradients():
    with tf.Graph().as_default():
        u, weights, (x, y, z, q), loss = _two_products_graph()
        gates = rewrite.GradientGates()
        with gates.recording([x.op, y.op, z.op, q.op], late=[q.op]):
            grads = tf.compat.v1.gradients(loss, [u, *weights])
        gates.finish({q.op: None})
        z_grad = _tanh_grads_of(z, "gradients/")
        assert grads[2].op in z_grad[0].control_inputs


def _tanh_grads_of(tanh: tf.Tensor, scope: str) -> list:
    return [op for op in tanh.graph.get_operations()
            if op.type == "TanhGrad" and op.inputs[0].op is tanh.op and op.name.startswith(scope)]


def _assert_same_values(plain: list, ordered: list) -> None:
    """The gradients with and without waits evaluate to the same values."""
    with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        a, b = session.run([plain, ordered])
    for p, g in zip(a, b):
        np.testing.assert_allclose(p, g, rtol=1e-6)

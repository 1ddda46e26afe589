"""A recomputed op's input gradients are released in order when some of them read a
recomputed tensor and some do not (rewrite.gated_gradients): what is built on the
gradients of one such op waits for those of the one before it.

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


def _two_products_graph():
    """x -> matmul(w1) -> tanh -> matmul(w2) -> loss, each product's input recomputed."""
    rng = np.random.RandomState(1)
    u = tf.constant(rng.randn(8, 16).astype(np.float32))
    w1 = tf.Variable(rng.randn(16, 16).astype(np.float32) * 0.1)
    w2 = tf.Variable(rng.randn(16, 16).astype(np.float32) * 0.1)
    x = tf.tanh(u * 2.0)
    y1 = tf.matmul(x, w1)
    h = tf.tanh(y1)
    y2 = tf.matmul(h, w2)
    return u, (w1, w2), (x, y1, h, y2), tf.reduce_sum(tf.tanh(y2))


def test_consumers_of_a_gated_ops_gradients_wait_for_the_gated_op_before_it():
    with tf.Graph().as_default():
        u, (w1, w2), (x, y1, h, y2), loss = _two_products_graph()
        plain = tf.compat.v1.gradients(loss, [u, w1, w2])
        with rewrite.gated_gradients([x.op, y1.op, h.op, y2.op]):
            gated = tf.compat.v1.gradients(loss, [u, w1, w2])
        # each MatMul's gradient is two products, one reading a recomputed input
        # (the one for the weight), one not: both MatMuls are gated
        gradient_of_w1, gradient_of_w2 = gated[1].op, gated[2].op
        assert gradient_of_w1.type == gradient_of_w2.type == "MatMul"
        tanh_grad_below_y1 = gated[0].op.inputs[0].op  # reads the gradient of x
        assert tanh_grad_below_y1.type == "TanhGrad", tanh_grad_below_y1.type
        # it waits for the upper product's gradients, and not for its own product's:
        # the lower filter gradient may run beside the chain below it
        assert gradient_of_w2 in tanh_grad_below_y1.control_inputs
        assert gradient_of_w1 not in tanh_grad_below_y1.control_inputs
        # nothing is left behind on the ops, and the first call was not gated
        assert y1.op._gradient_function is None and y2.op._gradient_function is None
        assert not plain[0].op.inputs[0].op.control_inputs
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            a, b = session.run([plain, gated])
    for p, g in zip(a, b):
        np.testing.assert_allclose(p, g, rtol=1e-6)


def test_a_single_gated_op_waits_for_nothing():
    """One gated op in a call: no gated op before it, so its consumers do not wait."""
    with tf.Graph().as_default():
        u, w, x, y, loss = _product_graph()
        with rewrite.gated_gradients([x.op, y.op]):
            gated = tf.compat.v1.gradients(loss, [u, w])
        assert not gated[0].op.inputs[0].op.control_inputs


def test_an_op_that_holds_more_than_it_receives_waits_on_its_own_gradients():
    """A product from 32 features down to 16 holds a recomputed input twice the size of
    the gradient it receives: its consumers wait for its own other gradient, at once
    (late, the U-Net's concat gradient ran beside the filter gradient holding the
    recomputed concat, and its peak moved)."""
    with tf.Graph().as_default():
        rng = np.random.RandomState(2)
        u = tf.constant(rng.randn(8, 32).astype(np.float32))
        w = tf.Variable(rng.randn(32, 16).astype(np.float32) * 0.1)
        x = tf.tanh(u * 2.0)
        y = tf.matmul(x, w)
        loss = tf.reduce_sum(tf.tanh(y))
        with rewrite.gated_gradients([x.op, y.op]):
            gated = tf.compat.v1.gradients(loss, [u, w])
        tanh_grad = gated[0].op.inputs[0].op
        assert tanh_grad.type == "TanhGrad", tanh_grad.type
        assert gated[1].op in tanh_grad.control_inputs


def test_gradients_that_all_read_recomputed_tensors_are_not_gated():
    """x * z with both recomputed: each gradient holds a recomputed tensor, waiting
    frees nothing (on the transformer's GELU, gating such products raised the peak
    from 29.3 to 31.1 MB)."""
    with tf.Graph().as_default() as graph:
        u, (w1, w2), (x, y1, h, y2), _ = _two_products_graph()
        z = tf.tanh(y2)
        product = h * z
        loss = tf.reduce_sum(tf.tanh(product))
        with rewrite.gated_gradients([x.op, y1.op, h.op, y2.op, z.op, product.op]):
            tf.compat.v1.gradients(loss, [u, w1, w2])
        ops = graph.get_operations()
        of_product = {op for op in ops if f"/{product.op.name}_grad/" in op.name}
        assert {op.type for op in of_product} >= {"Mul"}, of_product
        waits = [op.name for op in ops if of_product & set(op.control_inputs)]
        assert not waits, waits
        # the MatMuls below it still are gated (one of each one's gradients reads its
        # recomputed input, one not): the lower one's consumers wait for the upper one's
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

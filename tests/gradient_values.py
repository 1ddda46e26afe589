"""Helpers shared by the tests that compare gradients with tf.gradients."""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf


@contextlib.contextmanager
def control_flow_v1():
    """v1 control flow for graphs built inside; process-global, so always restored."""
    was_v2 = tf.compat.v1.control_flow_v2_enabled()
    tf.compat.v1.disable_control_flow_v2()
    try:
        yield
    finally:
        if was_v2:
            tf.compat.v1.enable_control_flow_v2()


def dense(value):
    """A numpy array from a fetched tensor or ``IndexedSlicesValue``."""
    if hasattr(value, "indices") and hasattr(value, "dense_shape"):
        out = np.zeros(value.dense_shape, dtype=value.values.dtype)
        np.add.at(out, value.indices, value.values)
        return out
    return np.asarray(value)


def kind(gradient):
    """None, 'sparse' (IndexedSlices) or 'dense': the structure tf.gradients gives."""
    if gradient is None:
        return None
    return "sparse" if isinstance(gradient, tf.IndexedSlices) else "dense"


def unrolled_lstm_states(x, kernel, recurrent):
    """The ``h`` of each step of a Python-unrolled LSTM over ``x`` ``[batch, steps,
    features]`` (``kernel`` ``[features, 4 units]``, ``recurrent`` ``[units, 4 units]``):
    every step reads the same weights, and ``c`` runs beside ``h``."""
    units = int(recurrent.shape[0])
    h = c = tf.zeros([int(x.shape[0]), units])
    states = []
    for t in range(int(x.shape[1])):
        i, f, g, o = tf.split(x[:, t] @ kernel + h @ recurrent, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.sigmoid(o) * tf.tanh(c)
        states.append(h)
    return states


@tf.custom_gradient
def swish_holding_its_insides(x):
    """A swish whose gradient closure holds its sigmoid and its result, both made inside
    the function (its result is the next layer's input)."""
    s = tf.sigmoid(x)
    y = x * s

    def grad(dy):
        return dy * (s + y * (1 - s))

    return y, grad

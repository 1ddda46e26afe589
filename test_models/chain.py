"""Elementwise chains for exact memory-arithmetic tests.

There are no variables: the input placeholder ``x`` (a vector of ``size``
elements of ``dtype``) is what tests differentiate with respect to. Every
intermediate tensor below is a vector of exactly ``size`` elements
(``size * dtype.size`` bytes: 1 MiB at the default ``size=262144`` float32),
except the scalar loss. No op has a hidden temporary of its own except the
reductions. The gradient of ``tanh`` (``TanhGrad``) reads the op's *output*,
so a plain backward pass keeps every ``tanh`` output alive until its gradient
is computed; ``AddV2`` and ``Mul`` by a constant keep nothing.

Three kinds (``kind=`` keyword, or the ``build_*`` helpers):

``'tanh'`` -- ``build_tanh_chain(n=100, size=262144)``::

    a_0 = x
    a_i = tanh(a_{i-1})                 for i = 1..n
    loss = reduce_sum(a_n)
    units = [a_1, ..., a_n]

``'dual'`` -- ``build_dual_chain(n=100, size=262144, c_scale=0.5)``: two
parallel tanh chains fed from the same input::

    b_0 = x
    c_0 = c_scale * x                   (one Mul; c_0 = x if c_scale is None)
    b_i = tanh(b_{i-1}),  c_i = tanh(c_{i-1})     for i = 1..n
    loss = reduce_sum(b_n) + reduce_sum(c_n)
    units = [b_1, c_1, b_2, c_2, ..., b_n, c_n]   (interleaved by depth)

  The default ``c_scale=0.5`` makes the two chains different computations:
  with ``c_scale=None`` they are identical and grappler's common-subexpression
  elimination may merge them into one.

``'residual'`` -- ``build_small_residual(n=100, size=262144)``: ``n`` residual
blocks, each of two tanh ops and one add::

    a_0 = x
    h_i = tanh(a_{i-1})
    g_i = tanh(h_i)
    a_i = a_{i-1} + g_i                 for i = 1..n
    loss = reduce_sum(a_n)
    units = [a_1, ..., a_n]             (block outputs)

  Per block the forward creates three ``size``-element tensors (h_i, g_i,
  a_i); the backward needs h_i and g_i (the tanh outputs) but not a_i.

If ``dtype`` is not float32 the loss is cast to float32 (one extra scalar op).
``unit_wrapper`` wraps each ``tanh`` of the chains and each residual block.
"""

import sys
from typing import Callable, Optional

import tensorflow as tf

from . import common

NAME = 'chain'
KINDS = ('tanh', 'dual', 'residual')
DEFAULTS = dict(n=100, size=262144, dtype=tf.float32, kind='tanh',
                c_scale=0.5)


def _sizes(size):
    cfg = common.resolve_sizes(DEFAULTS, size, NAME)
    cfg['dtype'] = tf.as_dtype(cfg['dtype'])
    if cfg['kind'] not in KINDS:
        raise ValueError('chain kind must be one of %s, got %r'
                         % (KINDS, cfg['kind']))
    if int(cfg['n']) < 1:
        raise ValueError('chain length n must be >= 1, got %r' % cfg['n'])
    return cfg


def make_params(seed=0, **size):
    """No variables; the Params object only carries the config."""
    del seed
    return common.Params(_sizes(size), scope=NAME)


def input_signature(**size):
    cfg = _sizes(size)
    return [tf.TensorSpec([cfg['size']], cfg['dtype'], name='x')]


def make_inputs(seed=0, **size):
    """x uniform in [-1, 1]."""
    cfg = _sizes(size)
    rng = common.input_rng(seed)
    x = rng.uniform(-1.0, 1.0, size=[cfg['size']])
    return [x.astype(cfg['dtype'].as_numpy_dtype)]


def _to_f32(t):
    return t if t.dtype == tf.float32 else tf.cast(t, tf.float32)


def forward(params, x, unit_wrapper: Optional[Callable] = None,
            training=True):
    """(loss, units) for the chain kind in ``params.config``."""
    del training
    cfg = params.config
    n, kind = int(cfg['n']), cfg['kind']
    units = []
    if kind == 'tanh':
        a = x
        for _ in range(n):
            a = common.apply_unit(tf.tanh, a, unit_wrapper)
            units.append(a)
        loss = tf.reduce_sum(a)
    elif kind == 'dual':
        b = x
        c = x if cfg['c_scale'] is None else x * tf.constant(
            cfg['c_scale'], dtype=x.dtype)
        for _ in range(n):
            b = common.apply_unit(tf.tanh, b, unit_wrapper)
            c = common.apply_unit(tf.tanh, c, unit_wrapper)
            units.extend([b, c])
        loss = tf.reduce_sum(b) + tf.reduce_sum(c)
    else:  # residual
        def block(a):
            return a + tf.tanh(tf.tanh(a))
        a = x
        for _ in range(n):
            a = common.apply_unit(block, a, unit_wrapper)
            units.append(a)
        loss = tf.reduce_sum(a)
    return _to_f32(loss), units


def build(seed=0, add_to_collection=False, unit_wrapper=None, **size):
    cfg = _sizes(size)
    return common.build_model('%s_%s' % (NAME, cfg['kind']),
                              sys.modules[__name__], seed, add_to_collection,
                              unit_wrapper, size)


def build_tanh_chain(n=100, size=262144, dtype=tf.float32, seed=0,
                     add_to_collection=False, unit_wrapper=None):
    """a_i = tanh(a_{i-1}), loss = sum(a_n); units = [a_1..a_n]."""
    return build(seed=seed, add_to_collection=add_to_collection,
                 unit_wrapper=unit_wrapper, n=n, size=size, dtype=dtype,
                 kind='tanh')


def build_dual_chain(n=100, size=262144, dtype=tf.float32, c_scale=0.5,
                     seed=0, add_to_collection=False, unit_wrapper=None):
    """Two tanh chains from x and c_scale*x; loss = sum(b_n) + sum(c_n)."""
    return build(seed=seed, add_to_collection=add_to_collection,
                 unit_wrapper=unit_wrapper, n=n, size=size, dtype=dtype,
                 kind='dual', c_scale=c_scale)


def build_small_residual(n=100, size=262144, dtype=tf.float32, seed=0,
                         add_to_collection=False, unit_wrapper=None):
    """a_i = a_{i-1} + tanh(tanh(a_{i-1})), loss = sum(a_n)."""
    return build(seed=seed, add_to_collection=add_to_collection,
                 unit_wrapper=unit_wrapper, n=n, size=size, dtype=dtype,
                 kind='residual')


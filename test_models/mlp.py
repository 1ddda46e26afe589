"""Deep MLP: ``depth`` hidden ReLU layers, softmax cross-entropy.

Sizes (``DEFAULTS``): depth=8, width=256, batch=32, input_dim=64, classes=10.

Graph::

    h_0 = x                                   [batch, input_dim] float32
    h_i = relu(h_{i-1} @ W_i + b_i)           [batch, width], i = 1..depth
    logits = h_depth @ W_out + b_out          [batch, classes]
    loss = mean(sparse_softmax_xent(logits, labels))

Inputs: ``x`` float32 [batch, input_dim] (standard normal), ``labels`` int32
[batch] (uniform in [0, classes)). Units: ``[h_1, ..., h_depth]``; the
``unit_wrapper`` wraps each hidden layer. Params: W_i, b_i for each hidden
layer then W_out, b_out (He-normal weights, zero biases), 2*depth+2 variables.
"""

import sys

import numpy as np
import tensorflow as tf

from . import common

NAME = 'mlp'
DEFAULTS = dict(depth=8, width=256, batch=32, input_dim=64, classes=10)


def _sizes(size):
    cfg = common.resolve_sizes(DEFAULTS, size, NAME)
    if int(cfg['depth']) < 1:
        raise ValueError('mlp depth must be >= 1, got %r' % cfg['depth'])
    return cfg


def make_params(seed=0, **size):
    cfg = _sizes(size)
    rng = common.param_rng(seed)
    p = common.Params(cfg, scope=NAME)
    fan_in = cfg['input_dim']
    for i in range(1, cfg['depth'] + 1):
        p.add('layer%d/w' % i,
              common.he_normal(rng, [fan_in, cfg['width']], fan_in))
        p.add('layer%d/b' % i, np.zeros([cfg['width']], np.float32))
        fan_in = cfg['width']
    p.add('out/w', common.glorot_uniform(
        rng, [fan_in, cfg['classes']], fan_in, cfg['classes']))
    p.add('out/b', np.zeros([cfg['classes']], np.float32))
    return p


def input_signature(**size):
    cfg = _sizes(size)
    return [tf.TensorSpec([cfg['batch'], cfg['input_dim']], tf.float32,
                          name='x'),
            tf.TensorSpec([cfg['batch']], tf.int32, name='labels')]


def make_inputs(seed=0, **size):
    cfg = _sizes(size)
    rng = common.input_rng(seed)
    x = rng.standard_normal([cfg['batch'], cfg['input_dim']]).astype(
        np.float32)
    labels = rng.randint(0, cfg['classes'], size=[cfg['batch']]).astype(
        np.int32)
    return [x, labels]


def forward(params, x, labels, unit_wrapper=None, training=True):
    del training
    cfg = params.config
    units = []
    h = x
    for i in range(1, cfg['depth'] + 1):
        w, b = params['layer%d/w' % i], params['layer%d/b' % i]

        def layer(t, w=w, b=b):
            return tf.nn.relu(tf.matmul(t, w) + b)
        h = common.apply_unit(layer, h, unit_wrapper)
        units.append(h)
    logits = tf.matmul(h, params['out/w']) + params['out/b']
    return common.mean_sparse_xent(logits, labels), units


def build(seed=0, add_to_collection=False, unit_wrapper=None, **size):
    return common.build_model(NAME, sys.modules[__name__], seed,
                              add_to_collection, unit_wrapper, size)

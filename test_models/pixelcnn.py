"""PixelCNN-style stack of masked convolutions with gated residual blocks.

Sizes (``DEFAULTS``): blocks=4, channels=32, image_size=16, batch=4,
levels=16 (intensity levels of the single-channel images), first_kernel=7,
kernel=3.

Masked convolution: the effective filter is ``w * mask`` (a constant), where
for a k x k filter with centre (c, c) the mask is 1 on rows above the centre,
on the centre row left of the centre, and -- type B only -- at the centre;
0 elsewhere (type A excludes the centre pixel itself). One grey channel, so
there is no colour-channel masking. NHWC float32, 'SAME' padding::

    x = tokens / (levels - 1) * 2 - 1             [batch, s, s, 1]
    h = masked_conv_A(x, first_kernel, channels) + b
    block(h), blocks times:
        a, g = split(masked_conv_B(h, kernel, 2*channels) + b, 2, axis=3)
        return h + conv1x1(tanh(a) * sigmoid(g), channels) + b
    logits = conv1x1(relu(conv1x1(relu(h), channels) + b), levels) + b
    loss = mean(sparse_softmax_xent(logits, tokens))   per pixel

Inputs: ``tokens`` int32 [batch, s, s] uniform in [0, levels). Units: output
of every gated residual block; ``unit_wrapper`` wraps each block.
"""

import sys

import numpy as np
import tensorflow as tf

from . import common

NAME = 'pixelcnn'
DEFAULTS = dict(blocks=4, channels=32, image_size=16, batch=4, levels=16,
                first_kernel=7, kernel=3)


def _sizes(size):
    cfg = common.resolve_sizes(DEFAULTS, size, NAME)
    for k in ('first_kernel', 'kernel'):
        if cfg[k] < 1 or cfg[k] % 2 == 0:
            raise ValueError('%s must be odd and >= 1, got %r' % (k, cfg[k]))
    if cfg['levels'] < 2:
        raise ValueError('levels must be >= 2, got %r' % cfg['levels'])
    return cfg


def causal_mask(k, cin, cout, mask_type):
    """[k, k, cin, cout] float32 mask of type 'A' or 'B'."""
    if mask_type not in ('A', 'B'):
        raise ValueError("mask_type must be 'A' or 'B'")
    c = k // 2
    m = np.zeros([k, k], np.float32)
    m[:c, :] = 1.0
    m[c, :c] = 1.0
    if mask_type == 'B':
        m[c, c] = 1.0
    return np.broadcast_to(m[:, :, None, None], [k, k, cin, cout]).copy()


def make_params(seed=0, **size):
    cfg = _sizes(size)
    rng = common.param_rng(seed)
    p = common.Params(cfg, scope=NAME)

    def conv(name, k, cin, cout):
        p.add(name + '/w', common.he_normal(rng, [k, k, cin, cout], k * k * cin))
        p.add(name + '/b', np.zeros([cout], np.float32))

    c = cfg['channels']
    conv('input', cfg['first_kernel'], 1, c)
    for i in range(cfg['blocks']):
        conv('block%d/masked' % i, cfg['kernel'], c, 2 * c)
        conv('block%d/proj' % i, 1, c, c)
    conv('out1', 1, c, c)
    conv('out2', 1, c, cfg['levels'])
    return p


def input_signature(**size):
    cfg = _sizes(size)
    s = cfg['image_size']
    return [tf.TensorSpec([cfg['batch'], s, s], tf.int32, name='tokens')]


def make_inputs(seed=0, **size):
    cfg = _sizes(size)
    rng = common.input_rng(seed)
    s = cfg['image_size']
    return [rng.randint(0, cfg['levels'], size=[cfg['batch'], s, s]).astype(
        np.int32)]


def _conv(x, p, name, mask_type=None):
    w = p[name + '/w']
    if mask_type is not None:
        k, _, cin, cout = w.shape.as_list()
        w = w * tf.constant(causal_mask(k, cin, cout, mask_type))
    y = tf.nn.conv2d(x, w, strides=[1, 1, 1, 1], padding='SAME')
    return y + p[name + '/b']


def _make_block(p, i):
    def block(h):
        a, g = tf.split(_conv(h, p, 'block%d/masked' % i, 'B'), 2, axis=3)
        return h + _conv(tf.tanh(a) * tf.sigmoid(g), p, 'block%d/proj' % i)
    return block


def logits_and_units(params, tokens, unit_wrapper=None):
    """(logits [batch, s, s, levels], units); logits at a pixel depend only
    on the pixels before it in raster order."""
    p = params
    cfg = p.config
    x = tf.cast(tokens, tf.float32) * (2.0 / (cfg['levels'] - 1)) - 1.0
    h = _conv(x[..., None], p, 'input', 'A')
    units = []
    for i in range(cfg['blocks']):
        h = common.apply_unit(_make_block(p, i), h, unit_wrapper)
        units.append(h)
    h = tf.nn.relu(_conv(tf.nn.relu(h), p, 'out1'))
    return _conv(h, p, 'out2'), units


def forward(params, tokens, unit_wrapper=None, training=True):
    del training
    logits, units = logits_and_units(params, tokens, unit_wrapper)
    return common.mean_sparse_xent(logits, tokens), units


def build(seed=0, add_to_collection=False, unit_wrapper=None, **size):
    return common.build_model(NAME, sys.modules[__name__], seed,
                              add_to_collection, unit_wrapper, size)

"""Small U-Net with an MSE loss against a synthetic target.

Sizes (``DEFAULTS``): levels=3, base=16, image_size=32, batch=4,
in_channels=3, out_channels=3, down='pool', up='transpose'.
``image_size`` must be divisible by ``2**(levels-1)``.

Level l (0 = full resolution, levels-1 = bottleneck) has ``c_l = base * 2**l``
channels at resolution ``image_size / 2**l``. All convs are 3x3 'SAME' with
bias, NHWC float32::

    block(t, c) = relu(conv3x3(relu(conv3x3(t, c)), c))

    d_0 = block(images, c_0)
    d_l = block(downsample(d_{l-1}), c_l)              l = 1..levels-1
    u_{levels-1} = d_{levels-1}
    u_l = block(concat([upsample(u_{l+1}, c_l), d_l]), c_l)   l = levels-2..0
    out = conv1x1(u_0, out_channels)
    loss = mean((out - target)**2)

``down='pool'``: 2x2 max pool, stride 2. ``down='conv'``: relu(3x3 conv,
stride 2, c_{l-1} channels, bias). ``up='transpose'``: 2x2
``conv2d_transpose``, stride 2, c_{l+1} -> c_l, bias. ``up='resize'``:
nearest-neighbour resize x2 then 3x3 conv c_{l+1} -> c_l with bias.

Inputs: ``images`` float32 [batch, s, s, in_channels] and ``target`` float32
[batch, s, s, out_channels], both standard normal. Units (2*levels-1
tensors), in order: ``[d_0, ..., d_{levels-1}, u_{levels-2}, ..., u_0]``.
``unit_wrapper`` wraps each ``block`` (its input is the downsampled tensor on
the down path and the concatenation on the up path; downsample, upsample and
concat stay outside the wrapped function).
"""

import sys

import numpy as np
import tensorflow as tf

from . import common

NAME = 'unet'
DEFAULTS = dict(levels=3, base=16, image_size=32, batch=4, in_channels=3,
                out_channels=3, down='pool', up='transpose')


def _sizes(size):
    cfg = common.resolve_sizes(DEFAULTS, size, NAME)
    if cfg['levels'] < 1:
        raise ValueError('levels must be >= 1, got %r' % cfg['levels'])
    if cfg['image_size'] % (2 ** (cfg['levels'] - 1)):
        raise ValueError('image_size %d not divisible by 2**(levels-1) = %d'
                         % (cfg['image_size'], 2 ** (cfg['levels'] - 1)))
    if cfg['down'] not in ('pool', 'conv'):
        raise ValueError("down must be 'pool' or 'conv', got %r" % cfg['down'])
    if cfg['up'] not in ('transpose', 'resize'):
        raise ValueError("up must be 'transpose' or 'resize', got %r"
                         % cfg['up'])
    return cfg


def _channels(cfg, level):
    return cfg['base'] * 2 ** level


def make_params(seed=0, **size):
    cfg = _sizes(size)
    rng = common.param_rng(seed)
    p = common.Params(cfg, scope=NAME)

    def conv(name, k, cin, cout):
        p.add(name + '/w', common.he_normal(rng, [k, k, cin, cout], k * k * cin))
        p.add(name + '/b', np.zeros([cout], np.float32))

    L = cfg['levels']
    cin = cfg['in_channels']
    for level in range(L):
        c = _channels(cfg, level)
        if level > 0 and cfg['down'] == 'conv':
            conv('down%d/downsample' % level, 3, cin, cin)
        conv('down%d/conv1' % level, 3, cin, c)
        conv('down%d/conv2' % level, 3, c, c)
        cin = c
    for level in range(L - 2, -1, -1):
        c, cup = _channels(cfg, level), _channels(cfg, level + 1)
        if cfg['up'] == 'transpose':
            # conv2d_transpose filter: [h, w, out_channels, in_channels]
            p.add('up%d/upsample/w' % level,
                  common.he_normal(rng, [2, 2, c, cup], 4 * cup))
            p.add('up%d/upsample/b' % level, np.zeros([c], np.float32))
        else:
            conv('up%d/upsample' % level, 3, cup, c)
        conv('up%d/conv1' % level, 3, 2 * c, c)
        conv('up%d/conv2' % level, 3, c, c)
    conv('out', 1, _channels(cfg, 0), cfg['out_channels'])
    return p


def input_signature(**size):
    cfg = _sizes(size)
    s, b = cfg['image_size'], cfg['batch']
    return [tf.TensorSpec([b, s, s, cfg['in_channels']], tf.float32,
                          name='images'),
            tf.TensorSpec([b, s, s, cfg['out_channels']], tf.float32,
                          name='target')]


def make_inputs(seed=0, **size):
    cfg = _sizes(size)
    rng = common.input_rng(seed)
    s, b = cfg['image_size'], cfg['batch']
    images = rng.standard_normal([b, s, s, cfg['in_channels']])
    target = rng.standard_normal([b, s, s, cfg['out_channels']])
    return [images.astype(np.float32), target.astype(np.float32)]


def _conv(x, p, name, stride=1):
    y = tf.nn.conv2d(x, p[name + '/w'], strides=[1, stride, stride, 1],
                     padding='SAME')
    return y + p[name + '/b']


def _make_block(p, prefix):
    def block(t):
        h = tf.nn.relu(_conv(t, p, prefix + '/conv1'))
        return tf.nn.relu(_conv(h, p, prefix + '/conv2'))
    return block


def _upsample(x, p, level, cfg):
    name = 'up%d/upsample' % level
    b, h, w, _ = x.shape.as_list()
    c = _channels(cfg, level)
    if cfg['up'] == 'transpose':
        batch = tf.shape(x)[0] if b is None else b  # the batch may be unknown (None)
        y = tf.nn.conv2d_transpose(x, p[name + '/w'], tf.stack([batch, 2 * h, 2 * w, c]),
                                   strides=[1, 2, 2, 1], padding='SAME')
        return y + p[name + '/b']
    y = tf.image.resize(x, [2 * h, 2 * w], method='nearest')
    return _conv(y, p, name)


def forward(params, images, target, unit_wrapper=None, training=True):
    del training
    p = params
    cfg = p.config
    L = cfg['levels']
    units, skips = [], []
    x = images
    for level in range(L):
        if level > 0:
            if cfg['down'] == 'pool':
                x = tf.nn.max_pool2d(x, ksize=2, strides=2, padding='VALID')
            else:
                x = tf.nn.relu(_conv(x, p, 'down%d/downsample' % level, stride=2))
        x = common.apply_unit(_make_block(p, 'down%d' % level), x, unit_wrapper)
        units.append(x)
        skips.append(x)
    for level in range(L - 2, -1, -1):
        up = _upsample(x, p, level, cfg)
        x = tf.concat([up, skips[level]], axis=3)
        x = common.apply_unit(_make_block(p, 'up%d' % level), x, unit_wrapper)
        units.append(x)
    out = _conv(x, p, 'out')
    loss = tf.reduce_mean(tf.square(out - target))
    return loss, units


def build(seed=0, add_to_collection=False, unit_wrapper=None, **size):
    return common.build_model(NAME, sys.modules[__name__], seed,
                              add_to_collection, unit_wrapper, size)

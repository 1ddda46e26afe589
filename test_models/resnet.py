"""CIFAR pre-activation ResNet v2 (He et al. 2016, "Identity Mappings in
Deep Residual Networks"), basic two-conv units.

Sizes (``DEFAULTS``): depth=20, batch=8, width=16, classes=10, image_size=32.
Variants: ``batch_norm=False`` leaves out every batch norm (the units then
start with a plain relu); ``projections='all'`` gives every unit a 1x1
projection shortcut (the original tool's test ResNet), ``'needed'`` only
where the stride or width changes; ``matmul_shortcuts=k`` writes the first k
projection shortcuts as a matrix product over the reshaped (and, for
stride 2, subsampled) activation instead of a 1x1 convolution: the same
values, a different graph.
``depth`` must be 6n+2 (20, 32, 44, 56, 110, 218, ...), else ValueError;
each of the three stages has n units, so there are 3n units in all.

Graph (NHWC, float32, 'SAME' padding, convolutions without bias)::

    x = conv3x3(images, width)                       [batch, 32, 32, width]
    stage s = 1, 2, 3 with widths width, 2*width, 4*width;
    the first unit of stages 2 and 3 has stride 2, every other stride 1.
    unit(x):
        p = relu(BN1(x))
        shortcut = x                  if stride 1 and channels unchanged
                 = conv1x1(p, stride) otherwise (projection)
        h = conv3x3(p, stride)
        h = conv3x3(relu(BN2(h)), 1)
        return h + shortcut
    y = relu(BN_final(x)); pooled = mean over H, W
    logits = pooled @ W_fc + b_fc
    loss = mean(sparse_softmax_xent(logits, labels))

Batch norm is ``tf.compat.v1.nn.fused_batch_norm`` (FusedBatchNormV3) with
batch statistics when ``training=True`` (epsilon 1e-5). There are no moving
average updates: each BN also has non-trainable ``moving_mean`` (0) and
``moving_var`` (1) variables, used only when ``training=False``, and never
part of ``Model.params``.

Inputs: ``images`` float32 [batch, image_size, image_size, 3] (standard
normal), ``labels`` int32 [batch]. Units: the output of every residual unit
(3n tensors); ``unit_wrapper`` wraps each residual unit.
"""

import sys

import numpy as np
import tensorflow as tf

from . import common

NAME = 'resnet'
DEFAULTS = dict(depth=20, batch=8, width=16, classes=10, image_size=32,
                batch_norm=True, projections='needed', matmul_shortcuts=0)
BN_EPSILON = 1e-5


def units_per_stage(depth):
    """n for depth = 6n + 2; ValueError for any other depth."""
    if not isinstance(depth, (int, np.integer)) or depth < 8 or \
            (depth - 2) % 6 != 0:
        raise ValueError('ResNet depth must be 6n+2 with n >= 1 '
                         '(20, 32, 44, 56, 110, 218, ...), got %r' % (depth,))
    return (int(depth) - 2) // 6


def _sizes(size):
    cfg = common.resolve_sizes(DEFAULTS, size, NAME)
    units_per_stage(cfg['depth'])
    if cfg['image_size'] % 4:
        raise ValueError('image_size must be divisible by 4, got %r'
                         % cfg['image_size'])
    return cfg


def _unit_layout(cfg):
    """[(stage, unit, in_ch, out_ch, stride)] for every residual unit."""
    n = units_per_stage(cfg['depth'])
    layout = []
    in_ch = cfg['width']
    for s in range(3):
        out_ch = cfg['width'] * 2 ** s
        for u in range(n):
            stride = 2 if (s > 0 and u == 0) else 1
            layout.append((s + 1, u + 1, in_ch, out_ch, stride))
            in_ch = out_ch
    return layout


def _add_bn(p, prefix, channels):
    p.add(prefix + '/gamma', np.ones([channels], np.float32))
    p.add(prefix + '/beta', np.zeros([channels], np.float32))
    p.add(prefix + '/moving_mean', np.zeros([channels], np.float32),
          trainable=False)
    p.add(prefix + '/moving_var', np.ones([channels], np.float32),
          trainable=False)


def _conv_w(rng, k, cin, cout):
    return common.he_normal(rng, [k, k, cin, cout], k * k * cin)


def make_params(seed=0, **size):
    cfg = _sizes(size)
    rng = common.param_rng(seed)
    p = common.Params(cfg, scope=NAME)
    w = cfg['width']
    p.add('conv0/w', _conv_w(rng, 3, 3, w))
    if cfg['projections'] not in ('needed', 'all'):
        raise ValueError("projections must be 'needed' or 'all', got %r"
                         % (cfg['projections'],))
    bn = cfg['batch_norm']
    for stage, unit, cin, cout, stride in _unit_layout(cfg):
        pre = 'stage%d/unit%d' % (stage, unit)
        if bn:
            _add_bn(p, pre + '/bn1', cin)
        p.add(pre + '/conv1/w', _conv_w(rng, 3, cin, cout))
        if bn:
            _add_bn(p, pre + '/bn2', cout)
        p.add(pre + '/conv2/w', _conv_w(rng, 3, cout, cout))
        if _projection(cfg, cin, cout, stride):
            p.add(pre + '/shortcut/w', _conv_w(rng, 1, cin, cout))
    final = 4 * w
    if bn:
        _add_bn(p, 'bn_final', final)
    p.add('fc/w', common.glorot_uniform(rng, [final, cfg['classes']], final,
                                        cfg['classes']))
    p.add('fc/b', np.zeros([cfg['classes']], np.float32))
    return p


def input_signature(**size):
    cfg = _sizes(size)
    s = cfg['image_size']
    return [tf.TensorSpec([cfg['batch'], s, s, 3], tf.float32, name='images'),
            tf.TensorSpec([cfg['batch']], tf.int32, name='labels')]


def make_inputs(seed=0, **size):
    cfg = _sizes(size)
    rng = common.input_rng(seed)
    s = cfg['image_size']
    images = rng.standard_normal([cfg['batch'], s, s, 3]).astype(np.float32)
    labels = rng.randint(0, cfg['classes'], size=[cfg['batch']]).astype(
        np.int32)
    return [images, labels]


def _projection(cfg, cin, cout, stride):
    return cfg['projections'] == 'all' or stride != 1 or cin != cout


def batch_norm(x, p, prefix, training):
    """Fused batch norm: batch statistics if training, else moving stats;
    the identity when the model has no batch norm."""
    if not p.config.get('batch_norm', True):
        return x
    if training:
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(
            x, p[prefix + '/gamma'], p[prefix + '/beta'],
            epsilon=BN_EPSILON, is_training=True)
    else:
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(
            x, p[prefix + '/gamma'], p[prefix + '/beta'],
            mean=p[prefix + '/moving_mean'],
            variance=p[prefix + '/moving_var'],
            epsilon=BN_EPSILON, is_training=False)
    return y


def _conv(x, w, stride):
    return tf.nn.conv2d(x, w, strides=[1, stride, stride, 1], padding='SAME')


def _matmul_shortcut(x, w, stride):
    """A 1x1 convolution written as a matrix product: same values."""
    if stride != 1:
        x = x[:, ::stride, ::stride, :]
    shape = tf.shape(x)
    cin, cout = w.shape[2], w.shape[3]
    flat = tf.reshape(x, [-1, cin])
    out = tf.matmul(flat, tf.reshape(w, [cin, cout]))
    return tf.reshape(out, tf.concat([shape[:3], [cout]], 0))


def _make_unit(p, pre, stride, projection, training, as_matmul=False):
    def unit(x):
        preact = tf.nn.relu(batch_norm(x, p, pre + '/bn1', training))
        if projection and as_matmul:
            shortcut = _matmul_shortcut(preact, p[pre + '/shortcut/w'], stride)
        elif projection:
            shortcut = _conv(preact, p[pre + '/shortcut/w'], stride)
        else:
            shortcut = x
        h = _conv(preact, p[pre + '/conv1/w'], stride)
        h = tf.nn.relu(batch_norm(h, p, pre + '/bn2', training))
        h = _conv(h, p[pre + '/conv2/w'], 1)
        return h + shortcut
    return unit


def forward(params, images, labels, unit_wrapper=None, training=True):
    p = params
    cfg = p.config
    units = []
    x = _conv(images, p['conv0/w'], 1)
    projections = 0
    for stage, unit, cin, cout, stride in _unit_layout(cfg):
        pre = 'stage%d/unit%d' % (stage, unit)
        projection = _projection(cfg, cin, cout, stride)
        as_matmul = projection and projections < cfg.get('matmul_shortcuts', 0)
        projections += projection
        fn = _make_unit(p, pre, stride, projection, training, as_matmul)
        x = common.apply_unit(fn, x, unit_wrapper)
        units.append(x)
    y = tf.nn.relu(batch_norm(x, p, 'bn_final', training))
    pooled = tf.reduce_mean(y, axis=[1, 2])
    logits = tf.matmul(pooled, p['fc/w']) + p['fc/b']
    return common.mean_sparse_xent(logits, labels), units


def build(seed=0, add_to_collection=False, unit_wrapper=None, **size):
    return common.build_model(NAME, sys.modules[__name__], seed,
                              add_to_collection, unit_wrapper, size)

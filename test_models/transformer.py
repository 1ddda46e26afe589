"""GPT-2-style decoder-only transformer (pre-LayerNorm, causal attention).

Sizes (``DEFAULTS``): layers=2, d_model=64, heads=4, seq_len=32, vocab=512,
batch=4, dropout=0.0, tied=False, dropout_seed=1234.

Graph (float32; ``linear`` = reshape to 2-D, matmul, add bias, reshape back)::

    h = gather(wte, tokens) + wpe                 [batch, seq_len, d_model]
    h = dropout(h)
    block(x), once per layer:
        a = causal_self_attention(LN_1(x))        heads of d_model/heads
        x = x + dropout(linear(a, c_proj))
        m = linear(gelu(linear(LN_2(x), c_fc)), mlp_proj)     4x hidden
        return x + dropout(m)
    logits = LN_f(h) @ W_out                      [batch, seq_len, vocab]
    loss = mean(sparse_softmax_xent(logits[:, :-1], tokens[:, 1:]))

Attention: q, k, v from one [d, 3d] projection; scores
``q @ k^T / sqrt(d_head)``, masked GPT-2 style (``w * mask - 1e9 * (1 -
mask)``, mask lower triangular), softmax, dropout, ``@ v``. gelu is the tanh
approximation (``tf.nn.gelu(approximate=True)``), as GPT-2. LayerNorm uses the
moments of the last axis, epsilon 1e-5.

The token embedding is read with ``tf.gather`` on the variable
(ResourceGather), so its gradient is ``tf.IndexedSlices``. With
``tied=False`` (default) the output matrix ``W_out`` is a separate
[d_model, vocab] variable and the embedding's gradient stays sparse; with
``tied=True`` ``W_out = wte^T`` (as GPT-2) and ``tf.gradients`` adds a dense
gradient to the sparse one, so the result is a dense Tensor.

``dropout`` > 0 uses ``tf.nn.dropout`` with op seeds ``dropout_seed + k``
(a fixed k per dropout site, see ``_Dropout``), only when ``training=True``; these
random ops are stateful, so two fresh builds draw the same masks but each
``Session.run`` draws new ones.

Inputs: ``tokens`` int32 [batch, seq_len] (uniform in [0, vocab)). Units:
output of every block (``layers`` tensors [batch, seq_len, d_model]);
``unit_wrapper`` wraps each block. ``build(add_to_collection=True)`` puts the
block outputs in the 'checkpoints' collection, as GPT-2 fine-tuning code did.
"""

import math
import sys

import numpy as np
import tensorflow as tf

from . import common

NAME = 'transformer'
DEFAULTS = dict(layers=2, d_model=64, heads=4, seq_len=32, vocab=512,
                batch=4, dropout=0.0, tied=False, dropout_seed=1234)
LN_EPSILON = 1e-5


def _sizes(size):
    cfg = common.resolve_sizes(DEFAULTS, size, NAME)
    if cfg['d_model'] % cfg['heads']:
        raise ValueError('d_model (%d) must be divisible by heads (%d)'
                         % (cfg['d_model'], cfg['heads']))
    if cfg['seq_len'] < 2:
        raise ValueError('seq_len must be >= 2 for a next-token loss')
    if not 0.0 <= cfg['dropout'] < 1.0:
        raise ValueError('dropout must be in [0, 1), got %r' % cfg['dropout'])
    return cfg


def make_params(seed=0, **size):
    cfg = _sizes(size)
    rng = common.param_rng(seed)
    p = common.Params(cfg, scope=NAME)
    d, v, L = cfg['d_model'], cfg['vocab'], cfg['layers']
    proj_std = 0.02 / math.sqrt(2 * L)   # GPT-2's scaled residual init

    def ln(name):
        p.add(name + '/g', np.ones([d], np.float32))
        p.add(name + '/b', np.zeros([d], np.float32))

    p.add('wte', common.normal(rng, [v, d], 0.02))
    p.add('wpe', common.normal(rng, [cfg['seq_len'], d], 0.01))
    for i in range(L):
        pre = 'h%d' % i
        ln(pre + '/ln_1')
        p.add(pre + '/attn/c_attn/w', common.normal(rng, [d, 3 * d], 0.02))
        p.add(pre + '/attn/c_attn/b', np.zeros([3 * d], np.float32))
        p.add(pre + '/attn/c_proj/w', common.normal(rng, [d, d], proj_std))
        p.add(pre + '/attn/c_proj/b', np.zeros([d], np.float32))
        ln(pre + '/ln_2')
        p.add(pre + '/mlp/c_fc/w', common.normal(rng, [d, 4 * d], 0.02))
        p.add(pre + '/mlp/c_fc/b', np.zeros([4 * d], np.float32))
        p.add(pre + '/mlp/c_proj/w', common.normal(rng, [4 * d, d], proj_std))
        p.add(pre + '/mlp/c_proj/b', np.zeros([d], np.float32))
    ln('ln_f')
    if not cfg['tied']:
        p.add('lm_head/w', common.normal(rng, [d, v], 0.02))
    return p


def input_signature(**size):
    cfg = _sizes(size)
    return [tf.TensorSpec([cfg['batch'], cfg['seq_len']], tf.int32,
                          name='tokens')]


def make_inputs(seed=0, **size):
    cfg = _sizes(size)
    rng = common.input_rng(seed)
    tokens = rng.randint(0, cfg['vocab'], size=[cfg['batch'], cfg['seq_len']])
    return [tokens.astype(np.int32)]


def _linear(x, w, b=None):
    """x [..., n] @ w [n, k] (+ b) -> [..., k], via a 2-D matmul."""
    shape = x.shape.as_list()
    k = w.shape[-1]
    y = tf.matmul(tf.reshape(x, [-1, shape[-1]]), w)
    if b is not None:
        y = y + b
    return tf.reshape(y, [-1 if d is None else d for d in shape[:-1]] + [k])


class _Dropout:
    """tf.nn.dropout with op seed ``dropout_seed + k`` for a fixed k per site.

    Sites: k = 0 for the embedding; k = 100*(i+1) + j in block i, with j = 0
    (attention weights), 1 (attention output), 2 (MLP output). A site keeps
    its seed if its block is traced again (e.g. by tf.recompute_grad).
    """

    def __init__(self, rate, seed, training):
        self.rate = float(rate) if training else 0.0
        self.seed = int(seed)

    def __call__(self, x, k):
        if self.rate <= 0.0:
            return x
        return tf.nn.dropout(x, rate=self.rate, seed=self.seed + k)


def _attention(x, p, pre, site, cfg, drop):
    _, s, d = x.shape.as_list()
    nh = cfg['heads']
    dh = d // nh
    qkv = _linear(x, p[pre + '/attn/c_attn/w'], p[pre + '/attn/c_attn/b'])
    q, k, v = tf.split(qkv, 3, axis=2)

    def heads(t):
        return tf.transpose(tf.reshape(t, [-1, s, nh, dh]), [0, 2, 1, 3])
    q, k, v = heads(q), heads(k), heads(v)
    w = tf.matmul(q, k, transpose_b=True) * (1.0 / math.sqrt(dh))
    mask = np.tril(np.ones([s, s], np.float32))
    w = w * tf.constant(mask) - tf.constant(1e9 * (1.0 - mask))
    w = drop(tf.nn.softmax(w, axis=-1), site)
    a = tf.matmul(w, v)                                  # [b, nh, s, dh]
    a = tf.reshape(tf.transpose(a, [0, 2, 1, 3]), [-1, s, d])
    return _linear(a, p[pre + '/attn/c_proj/w'], p[pre + '/attn/c_proj/b'])


def _make_block(p, i, cfg, drop):
    pre = 'h%d' % i
    site = 100 * (i + 1)

    def block(x):
        a = _attention(common.layer_norm(x, p[pre + '/ln_1/g'],
                                         p[pre + '/ln_1/b'], LN_EPSILON),
                       p, pre, site, cfg, drop)
        x = x + drop(a, site + 1)
        h = common.layer_norm(x, p[pre + '/ln_2/g'], p[pre + '/ln_2/b'],
                              LN_EPSILON)
        h = tf.nn.gelu(_linear(h, p[pre + '/mlp/c_fc/w'],
                               p[pre + '/mlp/c_fc/b']), approximate=True)
        m = _linear(h, p[pre + '/mlp/c_proj/w'], p[pre + '/mlp/c_proj/b'])
        return x + drop(m, site + 2)
    return block


def forward(params, tokens, unit_wrapper=None, training=True):
    p = params
    cfg = p.config
    drop = _Dropout(cfg['dropout'], cfg['dropout_seed'], training)
    h = tf.gather(p['wte'], tokens) + p['wpe']
    h = drop(h, 0)
    units = []
    for i in range(cfg['layers']):
        h = common.apply_unit(_make_block(p, i, cfg, drop), h,
                              unit_wrapper)
        units.append(h)
    h = common.layer_norm(h, p['ln_f/g'], p['ln_f/b'], LN_EPSILON)
    _, s, d = h.shape.as_list()  # the batch may be unknown (None)
    h2 = tf.reshape(h, [-1, d])
    if cfg['tied']:
        logits = tf.matmul(h2, p['wte'], transpose_b=True)
    else:
        logits = tf.matmul(h2, p['lm_head/w'])
    logits = tf.reshape(logits, [-1, s, cfg['vocab']])
    loss = common.mean_sparse_xent(logits[:, :-1], tokens[:, 1:])
    return loss, units


def build(seed=0, add_to_collection=False, unit_wrapper=None, **size):
    return common.build_model(NAME, sys.modules[__name__], seed,
                              add_to_collection, unit_wrapper, size)

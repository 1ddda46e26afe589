"""Build and run every model of test_models/ at a small size.

Graph mode (tf.compat.v1) and tf.function must agree, builds must be
deterministic, gradients finite; plus a few model-specific checks.
"""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np
import pytest
import tensorflow as tf

import test_models
from test_models import chain, common, pixelcnn, resnet, transformer, unet

SMALL = {
    'chain': dict(n=5, size=64),
    'mlp': dict(depth=3, width=16, batch=4, input_dim=8, classes=5),
    'resnet': dict(depth=8, batch=4, width=8, image_size=16),
    'transformer': dict(layers=2, d_model=32, heads=2, seq_len=8, vocab=64,
                        batch=2),
    'unet': dict(levels=2, base=4, image_size=8, batch=2),
    'pixelcnn': dict(blocks=2, channels=8, image_size=8, batch=2, levels=4),
}

# Extra variants: (model, size) pairs run through the same checks.
VARIANTS = [(name, size) for name, size in SMALL.items()] + [
    ('chain', dict(n=4, size=32, kind='dual')),
    ('chain', dict(n=4, size=32, kind='residual')),
    ('transformer', dict(SMALL['transformer'], tied=True)),
    ('unet', dict(SMALL['unet'], levels=3, down='conv', up='resize')),
]
VARIANT_IDS = ['%s-%d' % (name, i) for i, (name, _) in enumerate(VARIANTS)]


def _graph_run(name, size, seed=0, with_grads=True):
    """Build in a fresh v1 graph; return (model, loss, grads, grad_objs)."""
    with tf.Graph().as_default():
        model = test_models.MODELS[name].build(seed=seed, **size)
        xs = model.params if model.params else model.inputs
        grads = tf.compat.v1.gradients(model.loss, xs) if with_grads else []
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            loss, grad_vals = sess.run([model.loss, grads], model.feed_dict)
    return model, loss, grad_vals, grads


def _dense(g):
    if hasattr(g, 'indices') and hasattr(g, 'values'):   # IndexedSlicesValue
        return g.values
    return np.asarray(g)


@pytest.mark.parametrize('name,size', VARIANTS, ids=VARIANT_IDS)
def test_graph_build_loss_and_grads(name, size):
    model, loss, grad_vals, grads = _graph_run(name, size)
    assert model.loss.dtype == tf.float32
    assert model.loss.shape.rank == 0
    assert np.isfinite(loss)
    assert len(model.inputs) == len(model.feed_dict) >= 1
    assert model.units, 'every model has units'
    if name != 'chain':
        assert model.params
        for v in model.params:
            assert isinstance(v, tf.Variable) and v.trainable
            assert 'Resource' in type(v).__name__
    assert all(g is not None for g in grads)
    for g in grad_vals:
        assert np.all(np.isfinite(_dense(g)))


@pytest.mark.slow
@pytest.mark.parametrize('name,size', VARIANTS, ids=VARIANT_IDS)
def test_deterministic_and_tf_function_matches(name, size):
    _, loss1, grads1, _ = _graph_run(name, size)
    _, loss2, grads2, _ = _graph_run(name, size)
    assert loss1 == loss2
    for a, b in zip(grads1, grads2):
        np.testing.assert_array_equal(_dense(a), _dense(b))

    module = test_models.MODELS[name]
    params = module.make_params(seed=0, **size)        # eager, outside
    inputs = module.make_inputs(seed=0, **size)
    sig = module.input_signature(**size)

    @tf.function(input_signature=sig)
    def loss_fn(*args):
        return module.forward(params, *args)[0]

    fn_loss = loss_fn(*inputs).numpy()
    np.testing.assert_allclose(fn_loss, loss1, rtol=1e-4)


def test_units_and_collection():
    with tf.Graph().as_default():
        m = resnet.build(add_to_collection=True, **SMALL['resnet'])
        assert len(m.units) == 3 * resnet.units_per_stage(8)
        coll = tf.compat.v1.get_collection(common.CHECKPOINTS_COLLECTION)
        assert [t.name for t in coll] == [t.name for t in m.units]
    with tf.Graph().as_default():
        m = transformer.build(add_to_collection=True, **SMALL['transformer'])
        assert len(m.units) == 2
        coll = tf.compat.v1.get_collection('checkpoints')
        assert [t.name for t in coll] == [t.name for t in m.units]
        for t in m.units:
            assert t.shape.as_list() == [2, 8, 32]
    with tf.Graph().as_default():
        m = unet.build(**SMALL['unet'])
        assert len(m.units) == 3       # 2 down (incl. bottleneck) + 1 up
        assert not tf.compat.v1.get_collection('checkpoints')


def test_input_signature_matches_inputs():
    for name, size in VARIANTS:
        module = test_models.MODELS[name]
        arrays = module.make_inputs(seed=3, **size)
        specs = module.input_signature(**size)
        assert len(arrays) == len(specs)
        for a, s in zip(arrays, specs):
            assert list(a.shape) == s.shape.as_list()
            assert a.dtype == s.dtype.as_numpy_dtype
        again = module.make_inputs(seed=3, **size)
        for a, b in zip(arrays, again):
            np.testing.assert_array_equal(a, b)


def test_unknown_size_keyword_rejected():
    with pytest.raises(TypeError):
        mlp_sizes = dict(SMALL['mlp'], widht=3)
        test_models.mlp.make_params(**mlp_sizes)


def test_build_needs_graph_mode():
    with pytest.raises(RuntimeError):
        test_models.mlp.build(**SMALL['mlp'])


def test_chain_values_match_numpy():
    size, n = 32, 4
    x = chain.make_inputs(n=n, size=size)[0].astype(np.float64)
    # tanh chain
    m, loss, (gx,), _ = _graph_run('chain', dict(n=n, size=size))
    assert len(m.units) == n and all(
        t.shape.as_list() == [size] for t in m.units)
    a = x
    for _ in range(n):
        a = np.tanh(a)
    np.testing.assert_allclose(loss, a.sum(), rtol=1e-5)
    # dual chain: b from x, c from 0.5 x
    m, loss, _, _ = _graph_run('chain', dict(n=n, size=size, kind='dual'))
    assert len(m.units) == 2 * n
    b, c = x, 0.5 * x
    for _ in range(n):
        b, c = np.tanh(b), np.tanh(c)
    np.testing.assert_allclose(loss, b.sum() + c.sum(), rtol=1e-5)
    # residual
    m, loss, _, _ = _graph_run('chain', dict(n=n, size=size, kind='residual'))
    assert len(m.units) == n
    a = x
    for _ in range(n):
        a = a + np.tanh(np.tanh(a))
    np.testing.assert_allclose(loss, a.sum(), rtol=1e-5)
    # helper builders are the same models
    with tf.Graph().as_default():
        m = chain.build_small_residual(n=3, size=16)
        assert m.name == 'chain_residual' and len(m.units) == 3
        assert m.inputs[0].shape.as_list() == [16]
        assert m.params == []
    with tf.Graph().as_default():
        m = chain.build_dual_chain(n=3, size=16, c_scale=None)
        assert len(m.units) == 6
    with tf.Graph().as_default():
        m = chain.build_tanh_chain(n=3, size=16, dtype=tf.float16)
        assert m.units[0].dtype == tf.float16
        assert m.loss.dtype == tf.float32


def test_transformer_embedding_grad_is_sparse():
    size = SMALL['transformer']
    with tf.Graph().as_default():
        m = transformer.build(**size)
        wte = m.params[0]
        assert wte.shape.as_list() == [size['vocab'], size['d_model']]
        grads = tf.compat.v1.gradients(m.loss, m.params)
        assert isinstance(grads[0], tf.IndexedSlices)
        assert not any(isinstance(g, tf.IndexedSlices) for g in grads[1:])
    # Tied output embedding: tf.gradients adds a dense part -> dense Tensor.
    with tf.Graph().as_default():
        m = transformer.build(**dict(size, tied=True))
        grads = tf.compat.v1.gradients(m.loss, m.params)
        assert not isinstance(grads[0], tf.IndexedSlices)


def test_transformer_dropout_deterministic_first_run():
    size = dict(SMALL['transformer'], dropout=0.1)
    _, loss1, _, _ = _graph_run('transformer', size, with_grads=False)
    _, loss2, _, _ = _graph_run('transformer', size, with_grads=False)
    _, loss0, _, _ = _graph_run('transformer', SMALL['transformer'],
                                with_grads=False)
    assert loss1 == loss2
    assert loss1 != loss0
    with tf.Graph().as_default():
        m = transformer.build(**size)
        ops = {op.type for op in m.loss.graph.get_operations()}
        assert 'RandomUniform' in ops


@pytest.mark.parametrize('depth', [21, 22, 7, 0, 20.0])
def test_resnet_rejects_bad_depth(depth):
    with pytest.raises(ValueError):
        resnet.make_params(depth=depth, batch=2)
    with tf.Graph().as_default():
        with pytest.raises(ValueError):
            resnet.build(depth=depth, batch=2)


def test_resnet_depths():
    assert [resnet.units_per_stage(d) for d in (8, 20, 56, 110, 218)] == [
        1, 3, 9, 18, 36]


def test_resnet_recompute_grad_in_tf_function():
    size = SMALL['resnet']
    params = resnet.make_params(seed=1, **size)
    images, labels = resnet.make_inputs(seed=1, **size)

    def make(wrapper):
        @tf.function
        def step(images, labels):
            with tf.GradientTape() as tape:
                loss, _ = resnet.forward(params, images, labels,
                                         unit_wrapper=wrapper)
            return loss, tape.gradient(loss, params.trainable)
        return step

    loss_a, grads_a = make(None)(images, labels)
    loss_b, grads_b = make(tf.recompute_grad)(images, labels)
    np.testing.assert_allclose(loss_b.numpy(), loss_a.numpy(), rtol=1e-5)
    assert len(grads_a) == len(grads_b) == len(params.trainable)
    for v, ga, gb in zip(params.trainable, grads_a, grads_b):
        assert gb is not None, v.name
        np.testing.assert_allclose(gb.numpy(), ga.numpy(), rtol=1e-4,
                                   atol=1e-4 * np.abs(ga.numpy()).max() + 1e-7,
                                   err_msg=v.name)


def test_resnet_inference_mode_uses_moving_stats():
    size = SMALL['resnet']
    params = resnet.make_params(**size)
    images, labels = resnet.make_inputs(**size)
    train = resnet.forward(params, images, labels, training=True)[0]
    infer = resnet.forward(params, images, labels, training=False)[0]
    assert np.isfinite(infer.numpy()) and infer.numpy() != train.numpy()
    assert len(params.all) > len(params.trainable)


def test_pixelcnn_is_causal():
    size = SMALL['pixelcnn']
    params = pixelcnn.make_params(**size)
    (tokens,) = pixelcnn.make_inputs(**size)
    base = pixelcnn.logits_and_units(params, tokens)[0].numpy()
    r, c = 3, 4
    changed = tokens.copy()
    changed[:, r, c] = (changed[:, r, c] + 1) % size['levels']
    out = pixelcnn.logits_and_units(params, changed)[0].numpy()
    s = size['image_size']
    order = np.arange(s * s).reshape(s, s)
    before = order <= r * s + c          # incl. the pixel itself
    np.testing.assert_array_equal(out[:, before], base[:, before])
    assert np.abs(out[:, ~before] - base[:, ~before]).max() > 0

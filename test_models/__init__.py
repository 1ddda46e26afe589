"""Synthetic models for tests and benchmarks, in raw TensorFlow ops.

Each module (see ``common`` for the interface) has ``make_params``,
``forward``, ``make_inputs``, ``input_signature``, ``build`` and a
``DEFAULTS`` dict of size keywords. ``build`` needs a v1 graph; ``forward``
also runs in a ``tf.function`` body with variables made outside it. Weights
and data come from ``np.random.RandomState(seed)``: two builds with the same
seed give identical numbers.

Default sizes (small enough for one quick step on a 2-core CPU):

``chain``        n=100 elementwise ops on a vector of size=262144 float32
                 (1 MiB per intermediate); kinds 'tanh', 'dual', 'residual'
                 (``build_tanh_chain``, ``build_dual_chain``,
                 ``build_small_residual``). No variables.
``mlp``          depth=8 hidden ReLU layers of width=256, batch=32,
                 input_dim=64, classes=10.
``resnet``       CIFAR pre-activation ResNet v2, depth=20 (6n+2), width=16
                 (stages 16/32/64), batch=8, 32x32x3 images, classes=10.
``transformer``  GPT-2-style decoder, layers=2, d_model=64, heads=4,
                 seq_len=32, vocab=512, batch=4, dropout=0.0, tied=False.
``unet``         levels=3, base=16 channels (16/32/64), 32x32 images,
                 batch=4, 3 in / 3 out channels, max-pool down,
                 conv2d_transpose up, MSE loss.
``pixelcnn``     masked-conv PixelCNN, blocks=4 gated residual blocks of
                 channels=32, 16x16 grey images with levels=16, batch=4.
"""

from . import chain, common, mlp, pixelcnn, resnet, transformer, unet
from .common import CHECKPOINTS_COLLECTION, Model, Params

MODELS = {
    'chain': chain,
    'mlp': mlp,
    'resnet': resnet,
    'transformer': transformer,
    'unet': unet,
    'pixelcnn': pixelcnn,
}


def build(name, seed=0, add_to_collection=False, unit_wrapper=None, **size):
    """``MODELS[name].build(...)``, in the current (v1) default graph."""
    try:
        module = MODELS[name]
    except KeyError:
        raise KeyError('unknown model %r; known: %s' % (name, sorted(MODELS))) from None
    return module.build(seed=seed, add_to_collection=add_to_collection,
                        unit_wrapper=unit_wrapper, **size)


__all__ = ['MODELS', 'Model', 'Params', 'CHECKPOINTS_COLLECTION', 'build',
           'chain', 'common', 'mlp', 'pixelcnn', 'resnet', 'transformer', 'unet']

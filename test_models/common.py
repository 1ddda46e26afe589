"""Shared pieces of the synthetic test models.

Every model module in this package follows one interface:

``make_params(seed=0, **size) -> Params``
    Creates the model's ``tf.Variable`` s (resource variables) from numpy
    arrays drawn with ``np.random.RandomState(seed)``. Call it inside a v1
    graph (``with tf.Graph().as_default():``) or eagerly, outside any
    ``tf.function``. The returned object also remembers the sizes
    (``params.config``), so ``forward`` needs nothing else.

``forward(params, *inputs, unit_wrapper=None, training=True) -> (loss, units)``
    Pure function of the params and input tensors; creates no variables, so
    it can run in a v1 graph or in a ``tf.function`` body. ``unit_wrapper``
    (e.g. ``tf.recompute_grad``) is applied to the python function of each
    unit, which takes and returns one tensor and captures its variables by
    closure.

``make_inputs(seed=0, **size) -> list[np.ndarray]``
    Deterministic synthetic data, in the order of ``forward``'s inputs.

``input_signature(**size) -> list[tf.TensorSpec]``
    Static shapes and dtypes of those inputs (batch dimension known).

``build(seed=0, add_to_collection=False, unit_wrapper=None, **size) -> Model``
    Everything at once, for v1 graph mode: params, placeholders, forward and
    a feed dict. With ``add_to_collection`` every unit output is added to the
    ``'checkpoints'`` collection.

All functions of a module take the same ``**size`` keywords (each module's
``DEFAULTS``); a keyword a function does not need is ignored, an unknown
keyword raises ``TypeError``.
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

CHECKPOINTS_COLLECTION = 'checkpoints'

# Seed offset for synthetic data, so inputs and weights never share a stream.
_INPUT_SEED_OFFSET = 7919


@dataclasses.dataclass
class Model:
    """A model built in a v1 graph, ready for ``Session.run``."""
    name: str
    loss: tf.Tensor          # scalar float32 loss
    feed_dict: dict          # placeholder tensor -> numpy array (synthetic data)
    params: list             # trainable tf.Variable (resource variables)
    units: list              # output of each unit: natural checkpoint candidates
    inputs: list             # the input placeholders


class Params:
    """Named variables of one model, in creation order, plus its config.

    ``params['name']`` gives a variable, ``params.trainable`` the list of
    trainable ones (what ``Model.params`` holds), ``params.all`` every
    variable, ``params.config`` the resolved size keywords.
    """

    def __init__(self, config: Dict[str, Any], scope: str):
        self.config = dict(config)
        self.scope = scope
        self._vars: Dict[str, tf.Variable] = {}

    def add(self, name: str, value: np.ndarray, trainable: bool = True,
            dtype=tf.float32) -> tf.Variable:
        if name in self._vars:
            raise ValueError('duplicate parameter name %r' % name)
        value = np.asarray(value, dtype=tf.as_dtype(dtype).as_numpy_dtype)
        var = tf.Variable(value, trainable=trainable,
                          name='%s/%s' % (self.scope, name))
        self._vars[name] = var
        return var

    def __getitem__(self, name: str) -> tf.Variable:
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        return name in self._vars

    def __len__(self) -> int:
        return len(self._vars)

    @property
    def names(self) -> List[str]:
        return list(self._vars)

    @property
    def all(self) -> List[tf.Variable]:
        return list(self._vars.values())

    @property
    def trainable(self) -> List[tf.Variable]:
        return [v for v in self._vars.values() if v.trainable]

    def __repr__(self):
        return 'Params(scope=%r, %d variables, config=%r)' % (
            self.scope, len(self._vars), self.config)


def resolve_sizes(defaults: Dict[str, Any], size: Dict[str, Any],
                  model: str) -> Dict[str, Any]:
    """Defaults updated by ``size``; unknown keywords raise TypeError."""
    unknown = sorted(set(size) - set(defaults))
    if unknown:
        raise TypeError('%s: unknown size keyword(s) %s; known: %s' % (
            model, unknown, sorted(defaults)))
    out = dict(defaults)
    out.update(size)
    return out


def param_rng(seed: int) -> np.random.RandomState:
    """Random stream for weights."""
    return np.random.RandomState(seed)


def input_rng(seed: int) -> np.random.RandomState:
    """Random stream for synthetic data (distinct from the weights' one)."""
    return np.random.RandomState(seed + _INPUT_SEED_OFFSET)


def he_normal(rng: np.random.RandomState, shape, fan_in: int) -> np.ndarray:
    return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)


def glorot_uniform(rng: np.random.RandomState, shape, fan_in: int,
                   fan_out: int) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


def normal(rng: np.random.RandomState, shape, stddev: float) -> np.ndarray:
    return (rng.standard_normal(shape) * stddev).astype(np.float32)


def apply_unit(fn: Callable[[tf.Tensor], tf.Tensor], x: tf.Tensor,
               unit_wrapper: Optional[Callable] = None) -> tf.Tensor:
    """``unit_wrapper(fn)(x)`` if a wrapper is given, else ``fn(x)``."""
    if unit_wrapper is not None:
        fn = unit_wrapper(fn)
    return fn(x)


def _require_graph_mode(model: str):
    if tf.executing_eagerly():
        raise RuntimeError(
            '%s.build() needs a v1 graph: call it inside '
            '`with tf.Graph().as_default():`. For eager/tf.function use '
            'make_params() + forward() + make_inputs().' % model)


def build_model(name: str, module, seed: int, add_to_collection: bool,
                unit_wrapper: Optional[Callable],
                size: Dict[str, Any]) -> Model:
    """Generic v1-graph build from a module's make_params/forward/...

    Placeholders take the names of the module's ``input_signature`` specs.
    """
    _require_graph_mode(name)
    params = module.make_params(seed=seed, **size)
    with tf.name_scope(name + '_inputs'):
        placeholders = [
            tf.compat.v1.placeholder(spec.dtype, spec.shape, name=spec.name)
            for spec in module.input_signature(**size)]
    with tf.name_scope(name):
        loss, units = module.forward(params, *placeholders,
                                     unit_wrapper=unit_wrapper, training=True)
    if add_to_collection:
        for t in units:
            tf.compat.v1.add_to_collection(CHECKPOINTS_COLLECTION, t)
    arrays = module.make_inputs(seed=seed, **size)
    feed_dict = {p: a for p, a in zip(placeholders, arrays)}
    return Model(name=name, loss=loss, feed_dict=feed_dict,
                 params=params.trainable, units=list(units),
                 inputs=placeholders)


def layer_norm(x: tf.Tensor, gamma: tf.Variable, beta: tf.Variable,
               epsilon: float = 1e-5) -> tf.Tensor:
    """LayerNorm over the last axis, with batch moments of that axis."""
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + epsilon) * gamma + beta


def mean_sparse_xent(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Mean softmax cross-entropy with integer labels, as float32 scalar."""
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    return tf.reduce_mean(xent)

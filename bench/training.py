"""Training behaviour unchanged: the same SGD run with and without memory-saving gradients.

Two fresh graphs, the same weights (fixed numpy seeds), the same batches
(a new synthetic batch each step, by seed), dropout off: one trains with
``tf.compat.v1.gradients``, the other with ``memory_saving_gradients.gradients``;
both apply plain SGD.  The loss curves must agree within float tolerance.
"""

from __future__ import annotations

import dataclasses
from typing import List

import numpy as np

from memory_saving_gradients._tensorflow import tf, tf_gradients

from .models import test_models_package

DEFAULT_SIZE = dict(layers=4, d_model=64, heads=4, seq_len=32, batch=4, vocab=512, dropout=0.0)
QUICK_SIZE = dict(layers=2, d_model=16, heads=2, seq_len=8, batch=2, vocab=32, dropout=0.0)


@dataclasses.dataclass
class Curves:
    """Loss per step (before each update) for both runs."""

    model: str
    strategy: str
    steps: int
    learning_rate: float
    baseline: List[float]
    checkpointed: List[float]
    rtol: float

    @property
    def max_abs_diff(self) -> float:
        a, b = np.asarray(self.baseline), np.asarray(self.checkpointed)
        return float(np.max(np.abs(a - b))) if a.size else 0.0

    @property
    def max_rel_diff(self) -> float:
        a, b = np.asarray(self.baseline), np.asarray(self.checkpointed)
        return float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-12))) if a.size else 0.0

    @property
    def same(self) -> bool:
        return len(self.baseline) == len(self.checkpointed) and self.max_rel_diff <= self.rtol


def _train(strategy, steps, learning_rate, size, seed) -> List[float]:
    import memory_saving_gradients as msg

    tm = test_models_package()
    module = tm.transformer
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        model = module.build(seed=seed, add_to_collection=True, **size)
        if strategy is None:
            grads = tf_gradients(model.loss, model.params)
        else:
            grads = msg.gradients(model.loss, model.params, checkpoints=strategy)
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(learning_rate)
        train = optimizer.apply_gradients(list(zip(grads, model.params)))
        init = tf.compat.v1.global_variables_initializer()
    losses = []
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        for step in range(steps):
            arrays = module.make_inputs(seed=seed + 1000 + step % 8, **size)
            feed = dict(zip(model.inputs, arrays))
            loss, _ = session.run([model.loss, train], feed)
            losses.append(float(loss))
    return losses


def loss_curves(
    strategy: str = "memory",
    steps: int = 50,
    learning_rate: float = 0.5,
    size: dict = None,
    seed: int = 0,
    rtol: float = 1e-4,
) -> Curves:
    """Train the GPT-style transformer twice (tf.gradients, then ``strategy``)."""
    size = dict(DEFAULT_SIZE if size is None else size)
    size["dropout"] = 0.0
    baseline = _train(None, steps, learning_rate, size, seed)
    checkpointed = _train(strategy, steps, learning_rate, size, seed)
    return Curves("transformer " + " ".join(f"{k}={v}" for k, v in size.items()),
                  strategy, steps, learning_rate, baseline, checkpointed, rtol)

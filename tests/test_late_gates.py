"""Which gated products wait late (simulate.step_order(...).late), and what it keeps.

A recomputed product of a recomputed tensor and a weight (a convolution, a
matrix product) has two gradients: the weight's reads the recomputed tensor,
the other does not.  Waiting on each other (rewrite.GradientGates), they keep
the executor from holding the recomputed tensor while the chain below runs
ahead; waiting late, the weight's gradient runs beside that chain, as in
plain tf.gradients (docs/results.md: the gate narrowed ResNet-110's backward
from 1.8 to 1.6 kernels wide).  The memory model lets a product wait late
only where holding what its gradients read until the next product's stays
simulate.LATE_HEADROOM under the predicted peak.  Asserted here:

- the pairs follow the backward order, each with the next gated product;
- the predicted peak with the holds is the peak without them;
- where the hold would reach the peak (the bottom of a chain recomputed as
  one segment, where the weights' gradients have piled up) the product waits
  on its own gradients, at the top it waits late; more headroom never lets
  more wait late;
- measured: on a ResNet and the U-Net the peak with late gates is within 2%
  of the peak with every gate waiting on its own gradients, and within the
  plan's prediction, in each of three fresh builds.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
import test_models
from memory_saving_gradients import graph as graph_lib
from memory_saving_gradients import profiling, simulate
from memory_saving_gradients import schedule as schedule_lib

MB = 2.0**20


def _xs(model):
    return [getattr(v, "handle", v) for v in model.params]


def _chain(layers=8, width=64, batch=32):
    """tanh(x @ w) layers, the input kept: one recomputed segment over all of them."""
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(batch, width).astype(np.float32))
    weights, h = [], x
    for _ in range(layers):
        w = tf.Variable(rng.randn(width, width).astype(np.float32) * 0.1)
        weights.append(w)
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h), [w.handle for w in weights]


def _late(loss, xs, checkpoints):
    region = graph_lib.forward_region([loss], xs)
    schedule = schedule_lib.backward_schedule(region, [loss], xs, checkpoints)
    return region, schedule, simulate.step_order(region, [loss], xs, checkpoints, 32, (), schedule).late


def _resnet20(strategy):
    """A small ResNet, its xs as tensors, and the checkpoints ``strategy`` keeps."""
    model = test_models.build("resnet", depth=20, batch=8, add_to_collection=True)
    checkpoints = list(msg.plan(model.loss, model.params, checkpoints=strategy).checkpoints)
    return model, _xs(model), checkpoints


@pytest.mark.unit
def test_pairs_follow_the_backward_order(graph):
    model, xs, checkpoints = _resnet20("memory")
    _, schedule, pairs = _late(model.loss, xs, checkpoints)
    assert pairs, "no product waits late on a ResNet"
    steps = {step.index: step for step in schedule.steps}
    for (step, position), (next_step, next_position) in pairs:
        op = steps[step].segment.ops[position]
        assert op.type in ("Conv2D", "MatMul"), op.type
        # the next product: a later step, or further down the same one
        assert (next_step, -next_position) > (step, -position)
    keys = [pair[0] for pair in pairs]
    assert len(set(keys)) == len(keys)


@pytest.mark.unit
def test_the_predicted_peak_does_not_move(graph):
    model, xs, checkpoints = _resnet20("memory")
    region, schedule, _ = _late(model.loss, xs, checkpoints)
    replay = simulate._replayed(region, [model.loss], xs, checkpoints, simulate.Sizer(32), True,
                                (), schedule, gates=True)
    before = replay.timeline.peak(replay.step + 1)
    assert replay.timeline.live(replay.step + 1).max() == before
    replay.release_late()
    assert replay.timeline.peak(replay.step + 1) == before


@pytest.mark.unit
def test_products_near_the_peak_wait_on_their_own_gradients(graph):
    """A chain recomputed as one segment, its weights' gradients fetched: they pile up
    as the backward pass goes down, so its peak is at the bottom."""
    loss, xs = _chain()
    _, schedule, pairs = _late(loss, xs, [])
    (step,) = [s for s in schedule.steps if s.handling == schedule_lib.RECOMPUTED]
    products = sorted((i for i, op in enumerate(step.segment.ops) if op.type == "MatMul"),
                      reverse=True)
    late = {position for (_, position), _ in pairs}
    assert set(products[:2]) <= late, (products, late)  # the top: far under the peak
    assert not set(products[-3:]) & late, (products, late)  # the bottom: at it


@pytest.mark.unit
def test_more_headroom_never_lets_more_wait_late(graph, monkeypatch):
    model, xs, checkpoints = _resnet20("speed")
    counts = []
    for headroom in (0.0, 0.05, 0.2, 0.6):
        monkeypatch.setattr(simulate, "LATE_HEADROOM", headroom)
        counts.append(len(_late(model.loss, xs, checkpoints)[2]))
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], counts


def _peaks(name, late, builds=3, **size):
    """Measured peaks of 'memory' in ``builds`` fresh graphs, late gates on or off, and
    the plan's predicted peak."""
    peaks = []
    for _ in range(builds):
        with tf.Graph().as_default():
            model = test_models.build(name, add_to_collection=True, **size)
            predicted = msg.plan(model.loss, model.params, checkpoints="memory").predicted_peak_bytes
            if late:
                grads = msg.gradients(model.loss, model.params, checkpoints="memory")
            else:
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(simulate._Replay, "release_late", lambda self: ())
                    grads = msg.gradients(model.loss, model.params, checkpoints="memory")
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                _, metadata = profiling.traced_run(session, grads, model.feed_dict)
            peaks.append(sum(profiling.peak_memory(metadata).values()))
    return peaks, predicted


@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.parametrize("name, size", [
    ("resnet", dict(depth=56, batch=32)),
    ("unet", dict(levels=4, base=32, image_size=64, batch=8)),
], ids=["resnet56", "unet"])
def test_late_gates_keep_the_measured_peak(name, size):
    early, _ = _peaks(name, late=False, **size)
    late, predicted = _peaks(name, late=True, **size)
    shown = ([p / MB for p in early], [p / MB for p in late], predicted / MB)
    # the same plan: within 2% of every gate waiting on its own gradients (measured
    # +0.2 MB of 28.4 on this ResNet in some runs), and within the plan's prediction
    assert max(late) <= 1.02 * min(early), shown
    assert max(late) <= 1.01 * predicted, shown

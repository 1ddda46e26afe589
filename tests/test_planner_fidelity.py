"""The planner on the original tool's test model, and its own build time (issue 13).

The original project tested a ResNet without batch norm, with a 1x1
projection shortcut on every unit, at batch 128.  Re-created here at CI
size: 122 layers (60 units, 60 projection shortcuts), batch 128, 16x16
images (the original's 32x32 takes about 4x the memory and time).  Its
shortcuts are written two ways with the same values: all as 1x1
convolutions, or the first two as a matrix product over the reshaped
activation (``test_models.resnet``'s ``matmul_shortcuts``).

Measured peaks: allocation records of the second traced run, default
ConfigProto (see DESIGN.md "Measuring").  What is asserted, and why:

- 'memory' keeps at most 0.24x of plain ``tf.gradients``' peak, and no more
  than 'collection'.  The original's bound, 0.21x, is not asserted: it was
  set on 32x32 images, and at 16x16 the weights' gradients (fetched by the
  step, about 8 MB) weigh four times as much against the activations;
  measured here 0.233x with both writings (33.5 of 143.7 MB);
- the two writings' measured 'memory' peaks are within 5% of each other
  (before the cut fix they differed by 9%: 35.4 vs 32.3 MB), and so are
  their predictions;
- ``plan()`` is within 10% of the measured peak for plain and for 'memory'.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
import test_models
from bench import rewrite_time
from memory_saving_gradients import profiling

MB = 2.0**20
NO_BN = dict(depth=122, batch=128, image_size=16, batch_norm=False, projections="all")


def _measure(variant, **size):
    """(measured peak, predicted peak) of one variant on a freshly built model."""
    with tf.Graph().as_default():
        model = test_models.build("resnet", add_to_collection=True, **size)
        if variant == "tf":
            predicted = msg.plan(model.loss, model.params, checkpoints="collection"
                                 ).baseline_peak_bytes
            grads = tf.compat.v1.gradients(model.loss, model.params)
        else:
            predicted = msg.plan(model.loss, model.params, checkpoints=variant
                                 ).predicted_peak_bytes
            grads = msg.gradients(model.loss, model.params, checkpoints=variant)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            _, metadata = profiling.traced_run(session, grads, model.feed_dict)
    return sum(profiling.peak_memory(metadata).values()), predicted


@pytest.fixture(scope="module")
def no_bn_peaks():
    out = {}
    for matmuls in (0, 2):
        for variant in ("tf", "memory", "collection"):
            out[matmuls, variant] = _measure(variant, matmul_shortcuts=matmuls, **NO_BN)
    return out


@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.parametrize("matmuls", [0, 2], ids=["conv-shortcuts", "two-matmul-shortcuts"])
def test_no_bn_resnet_memory_bound(no_bn_peaks, matmuls):
    base, _ = no_bn_peaks[matmuls, "tf"]
    ours, _ = no_bn_peaks[matmuls, "memory"]
    collection, _ = no_bn_peaks[matmuls, "collection"]
    assert ours <= 0.24 * base, (ours / MB, base / MB, ours / base)
    assert ours <= collection, (ours / MB, collection / MB)


@pytest.mark.slow
@pytest.mark.memory
def test_no_bn_resnet_shortcut_writing_does_not_move_the_plan(no_bn_peaks):
    (conv, conv_pred), (mm, mm_pred) = no_bn_peaks[0, "memory"], no_bn_peaks[2, "memory"]
    assert abs(conv - mm) <= 0.05 * min(conv, mm), (conv / MB, mm / MB)
    assert abs(conv_pred - mm_pred) <= 0.05 * min(conv_pred, mm_pred), (
        conv_pred / MB, mm_pred / MB)


@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.parametrize("variant", ["tf", "memory"])
@pytest.mark.parametrize("matmuls", [0, 2], ids=["conv-shortcuts", "two-matmul-shortcuts"])
def test_no_bn_resnet_prediction_within_10_percent(no_bn_peaks, matmuls, variant):
    measured, predicted = no_bn_peaks[matmuls, variant]
    assert abs(predicted - measured) <= 0.10 * measured, (predicted / MB, measured / MB)


@pytest.mark.slow
@pytest.mark.cpu_time
def test_build_time_on_resnet110_against_tf_gradients():
    """gradients(checkpoints='memory') builds ResNet-110 (batch 2) in at most 4.5x
    tf.gradients' time, both warmed up, best of three: a generous bound for growth
    (measured 2.24x-2.92x on this 2-core machine; the issue's target is 3x), each
    measurement in a fresh process, as the benchmark takes it."""
    row = rewrite_time.in_fresh_process("warm_build_ratio", depth=110, batch=2)
    if row["ratio"] > 4.5:  # a busy machine only adds time: measure once more
        row = rewrite_time.in_fresh_process("warm_build_ratio", depth=110, batch=2)
    assert row["ratio"] <= 4.5, row


def _weight_heavy_mlp(batch=256, width=256, layers=8):
    x = tf.compat.v1.placeholder(tf.float32, [batch, width])
    h, weights = x, []
    for i in range(layers):
        weights.append(tf.compat.v1.get_variable(f"w{i}", [width, width]))
        h = tf.nn.relu(h @ weights[-1])
    feed = {x: np.random.default_rng(0).random((batch, width), dtype=np.float32)}
    return tf.reduce_sum(h * h), weights, feed


def _least_peak(fetches, feed, sessions=3):
    """The least measured peak of ``sessions`` sessions (the executor's order moves it)."""
    peaks = []
    for _ in range(sessions):
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            _, metadata = profiling.traced_run(session, fetches, feed)
        peaks.append(sum(profiling.peak_memory(metadata).values()))
    return min(peaks)


def _mlp_step_peaks(checkpoints):
    """(measured peak with the gradients fetched, measured peak of a training step that
    applies them, the plan) of the weight-heavy MLP.  The step's peak is the least of 8
    sessions: with 'memory' the executor's order moves it between 1.50 and 2.25 MB from
    one process to the next (least of 3: 2.25 MB once in a clean-clone run)."""
    with tf.Graph().as_default():
        loss, weights, feed = _weight_heavy_mlp()
        the_plan = msg.plan(loss, weights, checkpoints=checkpoints or "memory")
        grads = (tf.compat.v1.gradients(loss, weights) if checkpoints is None
                 else msg.gradients(loss, weights, checkpoints=checkpoints))
        step = tf.compat.v1.train.GradientDescentOptimizer(0.01).apply_gradients(
            zip(grads, weights))
        return _least_peak(grads, feed), _least_peak(step, feed, sessions=8), the_plan


@pytest.mark.memory
def test_plan_says_both_peaks_where_fetched_weight_gradients_hide_the_saving():
    """Eight 256x256 layers at batch 256: the weights' gradients (2 MB) outweigh the
    activations. Fetched, 'memory' saves about a tenth; in a step that applies each
    gradient as it is made, the activations dominate and it saves about a third. plan()
    gives both (each within 25% of the measured peak: the model leaves out the
    executor's order), and the strategy rewrites because the step saves."""
    plain_fetched, plain_step, the_plan = _mlp_step_peaks(None)
    ours_fetched, ours_step, _ = _mlp_step_peaks("memory")
    summary = (f"fetched: plain {plain_fetched / MB:.2f} MB, 'memory' {ours_fetched / MB:.2f} MB; "
               f"step: plain {plain_step / MB:.2f} MB, 'memory' {ours_step / MB:.2f} MB;\n{the_plan}")
    print(summary)
    assert the_plan.checkpoints, summary
    assert ours_step <= 0.8 * plain_step, summary
    assert the_plan.in_step_ratio <= the_plan.predicted_ratio - 0.2, summary
    assert "in a training step that applies each gradient" in str(the_plan), summary
    for predicted, measured in ((the_plan.predicted_peak_bytes, ours_fetched),
                                (the_plan.baseline_peak_bytes, plain_fetched),
                                (the_plan.in_step_peak_bytes, ours_step),
                                (the_plan.in_step_baseline_peak_bytes, plain_step)):
        assert abs(predicted - measured) <= 0.25 * measured, summary


def _unrolled_lstm(batch, steps=16, hidden=128, features=32, fed=None):
    """A Python-unrolled LSTM and four dense layers: every step reads the same kernels, so
    each kernel gets ``steps`` gradients that ``tf.gradients`` sums when the last is made.
    ``batch`` None: an unknown batch, fed ``fed``."""
    rng = np.random.default_rng(0)
    x = tf.compat.v1.placeholder(tf.float32, [batch, steps, features])
    kernel = tf.compat.v1.get_variable("kernel", [features, 4 * hidden])
    recurrent = tf.compat.v1.get_variable("recurrent", [hidden, 4 * hidden])
    dense = [tf.compat.v1.get_variable(f"dense{i}", [hidden, hidden]) for i in range(4)]
    h = c = tf.zeros_like(x[:, 0, :1]) * tf.zeros([1, hidden])
    for t in range(steps):
        i, f, g, o = tf.split(x[:, t] @ kernel + h @ recurrent, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.sigmoid(o) * tf.tanh(c)
    for w in dense:
        h = tf.tanh(h @ w)
    feed = {x: rng.random((batch or fed, steps, features), dtype=np.float32)}
    return tf.reduce_mean(h * h), [kernel, recurrent] + dense, feed


def _lstm_step_peak(batch, checkpoints, fed=None, planned_at=None):
    """(measured peak of a training step, its plan) of the unrolled LSTM; ``batch`` None:
    the plan is made for ``planned_at`` and the step fed ``fed``."""
    with tf.Graph().as_default():
        loss, weights, feed = _unrolled_lstm(batch, fed=fed)
        the_plan = msg.plan(loss, weights, checkpoints=checkpoints or "memory",
                            batch_size=planned_at)
        if checkpoints is not None and planned_at is not None:
            checkpoints = list(the_plan.checkpoints)
        grads = (tf.compat.v1.gradients(loss, weights) if checkpoints is None
                 else msg.gradients(loss, weights, checkpoints=checkpoints))
        step = tf.compat.v1.train.GradientDescentOptimizer(0.01).apply_gradients(
            zip(grads, weights))
        return _least_peak(step, feed), the_plan


@pytest.mark.memory
@pytest.mark.filterwarnings("ignore::memory_saving_gradients.NothingKeptWarning")
def test_weights_read_by_every_step_of_a_loop_hold_their_gradients_until_summed():
    """At batch 32 the recurrent kernel's 16 gradients (256 KB each) outweigh the
    activations. They are held until the last is made: plain's step measured 4.9-5.3 MB
    (least of three sessions, in several runs), which the model predicted at 2.3 MB when
    it freed each as it was made; 'memory' then chose a plan that measured 6.2 MB, above
    plain's. Now the prediction is within 15% of the measured step (5.25 MB), and no
    strategy keeps anything here (plain tf.gradients, the same graph as plain's)."""
    plain, the_plan = _lstm_step_peak(32, None)
    summary = f"plain step {plain / MB:.2f} MB;\n{the_plan}"
    assert abs(the_plan.in_step_baseline_peak_bytes - plain) <= 0.15 * plain, summary
    for strategy in ("memory", "balanced"):
        with tf.Graph().as_default():
            loss, weights, _ = _unrolled_lstm(32)
            chosen = msg.plan(loss, weights, checkpoints=strategy)
        assert not chosen.checkpoints, f"{strategy}: {chosen}; {summary}"


@pytest.mark.slow
@pytest.mark.memory
def test_the_sums_of_a_weights_gradients_run_when_their_parts_are_made():
    """A plan made for batch 512 and fed 8: the weights' gradients outweigh the
    activations. Where two recomputed segments differentiate one product, a variable
    read gets two gradients and the rewrite sums them; grappler folded that sum into the
    variable's (one ``AddN`` of every part), so all 24 of the recurrent kernel's 256 KB
    gradients were alive at once: the step measured 8.6 MB against 6.2 predicted and
    plain's 5.1. The rewrite's sums are now kept from that folding: 5.4 MB measured.
    Bounds: the prediction plus 5%, plain's measured step plus 15%."""
    plain, _ = _lstm_step_peak(None, None, fed=8)
    ours, the_plan = _lstm_step_peak(None, "memory", fed=8, planned_at=512)
    predicted = the_plan.peak_at(8, in_step=True)
    summary = (f"ours {ours / MB:.2f} MB, predicted {predicted / MB:.2f} MB, "
               f"plain {plain / MB:.2f} MB;\n{the_plan}")
    assert the_plan.checkpoints, summary
    assert ours <= 1.05 * predicted, summary
    assert ours <= 1.15 * plain, summary


def _inception_like_blocks(blocks=6, channels=32, batch=8, size=16):
    """Blocks of four conv-BN-ReLU branches (1, 2 and 5 long, and one after an average
    pool), concatenated; returns (loss, weights, every layer's output in order)."""
    rng = np.random.default_rng(0)
    layers, weights = [], []

    def variable(*shape):
        weights.append(tf.Variable(
            (rng.normal(size=shape) / np.sqrt(np.prod(shape[:-1]))).astype("float32")))
        return weights[-1]

    def conv_bn_relu(h, kernel, out):
        conv = tf.nn.conv2d(h, variable(kernel, kernel, int(h.shape[-1]), out), 1, "SAME")
        normed, *_ = tf.raw_ops.FusedBatchNormV3(
            x=conv, scale=variable(out), offset=variable(out), mean=tf.zeros([out]),
            variance=tf.ones([out]), is_training=True)
        layers.extend([conv, normed, tf.nn.relu(normed)])
        return layers[-1]

    h = conv_bn_relu(tf.constant(rng.normal(size=(batch, size, size, 3)).astype("float32")),
                     3, channels)
    quarter = channels // 4
    for _ in range(blocks):
        long = conv_bn_relu(h, 1, quarter)
        for _ in range(4):
            long = conv_bn_relu(long, 3, quarter)
        pooled = tf.nn.avg_pool2d(h, 3, 1, "SAME")
        layers.append(pooled)
        h = tf.concat([conv_bn_relu(h, 1, quarter),
                       conv_bn_relu(conv_bn_relu(h, 1, quarter), 3, quarter), long,
                       conv_bn_relu(pooled, 1, quarter)], -1)
        layers.append(h)
    logits = tf.matmul(tf.reduce_mean(h, [1, 2]), variable(channels, 10))
    return tf.reduce_sum(tf.nn.log_softmax(logits)[:, 0]), weights, layers


@pytest.mark.memory
def test_a_list_whose_segments_overlap_is_planned_as_measured(graph, measure_peak):
    """Every 11th layer's output of Inception-like blocks, none of them a block's output:
    each kept tensor's segment reaches back across blocks and the segments overlap.  A
    step's tf.gradients call sums its contributions to each of its inputs; the memory
    model held them apart until the input's producer ran (in a helper's variant, 24
    gradients of one kept tensor where the step held 8), and predicted 6.88 MB against
    5.60 measured (1.23x).  Within 10% now (5.43 predicted, 5.53 measured)."""
    loss, weights, layers = _inception_like_blocks()
    kept = layers[5:-1:11]
    the_plan = msg.plan(loss, weights, checkpoints=kept)
    ours, _ = measure_peak(msg.gradients(loss, weights, checkpoints=kept))
    plain, _ = measure_peak(tf.compat.v1.gradients(loss, weights))
    said = f"measured {ours / 2**20:.2f} MB, plain {plain / 2**20:.2f}\n{the_plan}"
    assert abs(the_plan.predicted_peak_bytes / ours - 1) <= 0.1, said
    assert ours < 0.7 * plain, said

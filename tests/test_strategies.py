"""Automatic checkpoints: 'speed', 'memory', memory budgets and plan() (issue 3).

Values are compared with tf.compat.v1.gradients in the same Session.run.
Memory figures are measured peaks (allocation records of the second traced
run, default ConfigProto, grappler on) of the same graph built twice, once
with plain tf.gradients and once with the strategy; the bounds are the
issue's, the slack stated where a prediction is compared.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg
import test_models
from memory_saving_gradients import checkpointing, memo, profiling, strategies
from memory_saving_gradients import graph as graph_lib

MB = 2.0**20


def _xs(model):
    return model.params or model.inputs


def _measure(name, variant, memory_budget=None, runs=1, spread=False, **size):
    """Build the model in a fresh graph, take gradients one way, return (peak bytes, plan):
    the least peak of ``runs`` traced steps (each after a warm-up), or with
    ``spread`` the least and the most."""
    graph = tf.Graph()
    with graph.as_default():
        model = test_models.build(name, **size)
        xs = _xs(model)
        if variant == "tf":
            grads = tf.compat.v1.gradients(model.loss, xs)
            the_plan = msg.plan(model.loss, xs, checkpoints="memory")
        else:
            the_plan = msg.plan(model.loss, xs, checkpoints=variant, memory_budget=memory_budget)
            grads = msg.gradients(model.loss, xs, checkpoints=variant, memory_budget=memory_budget)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            peaks = []
            for _ in range(runs):
                _, metadata = profiling.traced_run(session, grads, model.feed_dict)
                peaks.append(sum(profiling.peak_memory(metadata).values()))
    return ((min(peaks), max(peaks)) if spread else min(peaks)), the_plan


def _compare(name, strategy, **size):
    graph = tf.Graph()
    with graph.as_default():
        model = test_models.build(name, **size)
        xs = _xs(model)
        ours = msg.gradients(model.loss, xs, checkpoints=strategy)
        theirs = tf.compat.v1.gradients(model.loss, xs)
        assert [g is None for g in ours] == [g is None for g in theirs]
        assert [type(g) for g in ours] == [type(g) for g in theirs]
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            a, b = session.run(
                ([tf.convert_to_tensor(g) for g in ours if g is not None],
                 [tf.convert_to_tensor(g) for g in theirs if g is not None]),
                model.feed_dict,
            )
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)


MODELS = [
    ("chain", dict(n=30, size=1024)),
    ("resnet", dict(depth=20, batch=4)),
    ("transformer", dict(layers=3)),
    ("unet", dict()),
    ("mlp", dict()),
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["speed", "memory"])
@pytest.mark.parametrize("name,size", MODELS, ids=[m[0] for m in MODELS])
def test_strategy_gradients_equal_tf_gradients(name, size, strategy):
    _compare(name, strategy, **size)


def test_budgeted_gradients_equal_tf_gradients():
    graph = tf.Graph()
    with graph.as_default():
        model = test_models.build("resnet", depth=20, batch=4)
        baseline = msg.plan(model.loss, model.params).baseline_peak_bytes
        ours = msg.gradients(model.loss, model.params, memory_budget=0.7 * baseline,
                             checkpoints="memory")
        theirs = tf.compat.v1.gradients(model.loss, model.params)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            a, b = session.run((ours, theirs), model.feed_dict)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)


def test_speed_chooses_by_op_type_not_name(graph):
    x = tf.compat.v1.placeholder(tf.float32, [4, 4])
    w = tf.Variable(np.eye(4, dtype=np.float32))
    product = tf.matmul(x, w, name="relu_not_a_matmul")
    activation = tf.nn.relu(product, name="conv_not_a_conv")
    loss = tf.reduce_sum(tf.tanh(tf.matmul(activation, w, name="plain")))
    # the rule itself: on a graph this small 'speed' saves nothing, so gradients() and
    # plan() fall back to plain tf.gradients (test_speed_falls_back_where_it_saves_nothing)
    chosen = strategies.speed([loss], [x], graph_lib.forward_region([loss], [x]))
    names = {t.name for t in chosen}
    assert "relu_not_a_matmul:0" in names and "plain:0" in names
    assert "conv_not_a_conv:0" not in names


def test_speed_does_not_count_a_shape_read_as_a_reader(graph):
    """With an unknown batch, every reshape of an activation (a Keras Dense on a 3-D
    input) reads its shape too: that ``Shape`` op is no second reader, and the
    activation is not kept for it (on a Keras ViT at batch 32 'speed' kept every GELU
    output for it, planned 89 MB against plain's 86, and fell back; measured 74.6)."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 16, 8])
    w = tf.Variable(np.eye(8, dtype=np.float32))
    h = x
    for i in range(3):
        h = tf.tanh(h, name=f"activation_{i}")
        flat = tf.reshape(h, [-1, 8])  # what tensordot does: reads h's shape and values
        h = tf.reshape(tf.matmul(flat, w), tf.shape(h), name=f"product_{i}")
    loss = tf.reduce_sum(h)
    chosen = {t.name for t in strategies.speed([loss], [x], graph_lib.forward_region([loss], [x]))}
    assert {"activation_0:0", "activation_1:0", "activation_2:0"}.isdisjoint(chosen), chosen


def _relu_mlp(width=64, batch=256, depth=6, tanh_too=False):
    """A ReLU MLP (ReLU then tanh with ``tanh_too``) in the default graph: (loss, weights, feed)."""
    rng = np.random.default_rng(0)
    x = tf.compat.v1.placeholder(tf.float32, [batch, width])
    ws = [tf.Variable((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32))
          for _ in range(depth)]
    h = x
    for w in ws:
        h = tf.nn.relu(tf.matmul(h, w))
        if tanh_too:
            h = tf.tanh(h)
    return tf.reduce_sum(h * h), ws, {x: rng.standard_normal((batch, width)).astype(np.float32)}


def _traced_peak(grads, feed, sessions: int = 3) -> int:
    """The least allocator peak of one traced step in each of ``sessions`` sessions: with
    buffers this small (0.5 MB), the executor's order moves one session's peak by 12%."""
    peaks = []
    for _ in range(sessions):
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(grads, feed)  # warm-up
            _, metadata = profiling.traced_run(session, grads, feed)
        peaks.append(sum(profiling.peak_memory(metadata).values()))
    return min(peaks)


def test_speed_falls_back_where_it_saves_too_little(monkeypatch):
    """'speed' keeps its plan only where it is predicted to save at least
    RULE_MIN_SAVING of plain's peak (2%: the memory model's error; an embedding before
    four Dense(256) layers at batch 16 was predicted 9.00 against 9.01 MB, for 1.07x
    the time).  On a ReLU-tanh MLP whose plan saves a fraction s: with the threshold
    just above s it warns with the saving it found and uses plain tf.gradients; just
    below s it rewrites."""
    memo.forget()  # plans are remembered by graph structure: plan again
    with tf.Graph().as_default():
        loss, ws, _ = _relu_mlp(tanh_too=True)
        saving = 1 - msg.plan(loss, ws, checkpoints="speed").predicted_ratio
    assert checkpointing.RULE_MIN_SAVING < saving < 0.9, saving
    for above, rewrites in ((0.01, False), (-0.01, True)):
        memo.forget()
        monkeypatch.setattr(checkpointing, "RULE_MIN_SAVING", saving + above)
        with tf.Graph().as_default() as graph:
            loss, ws, _ = _relu_mlp(tanh_too=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                msg.gradients(loss, ws, checkpoints="speed")
            said = [str(w.message) for w in caught if w.category is msg.NothingKeptWarning]
            recomputed = [op for op in graph.get_operations() if "recompute" in op.name]
            assert bool(recomputed) == rewrites, said
            if not rewrites:
                assert len(said) == 1 and f"'speed' saves only {saving:.1%}" in said[0], said


@pytest.mark.memory
def test_speed_falls_back_where_it_saves_nothing():
    """On a ReLU MLP 'speed' would keep each matmul's output in place of its ReLU's, the
    same bytes: recomputing would cost time for nothing.  gradients() warns (once per
    graph structure), and it and plan() are plain tf.gradients; the kept list itself, forced, measures no lower peak (so
    the fallback loses nothing), and with a tanh after each ReLU 'speed' rewrites."""
    with tf.Graph().as_default() as graph:
        loss, ws, feed = _relu_mlp()
        want = tf.compat.v1.gradients(loss, ws)
        with pytest.warns(msg.NothingKeptWarning, match="'speed' saves nothing.*plain tf.gradients") as warned:
            got = msg.gradients(loss, ws, checkpoints="speed")
        said = str(warned[0].message)
        # the reason names what was kept; every shape is known, so no batch is assumed
        assert "a MatMul's output" in said and "unknown dimensions" not in said, said
        assert not [op for op in graph.get_operations() if "recompute" in op.name]
        the_plan = msg.plan(loss, ws, checkpoints="speed")  # remembered: warned once above
        assert the_plan.checkpoints == () and the_plan.recompute_cost == 0
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for a, b in zip(*session.run([got, want], feed)):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        plain = _traced_peak(want, feed)
        x = next(iter(feed))
        forced = msg.gradients(loss, ws, checkpoints=strategies.speed(
            [loss], [x], graph_lib.forward_region([loss], [x])))
        assert [op for op in graph.get_operations() if "recompute" in op.name]
        kept_matmuls = _traced_peak(forced, feed)
    # the same bytes kept (slack: 3%, the executor's order of the small buffers)
    assert kept_matmuls >= 0.97 * plain, (kept_matmuls / MB, plain / MB)
    with tf.Graph().as_default() as graph:
        loss, ws, feed = _relu_mlp(tanh_too=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", msg.NothingKeptWarning)
            the_plan = msg.plan(loss, ws, checkpoints="speed")
            msg.gradients(loss, ws, checkpoints="speed")
        assert the_plan.checkpoints and the_plan.predicted_peak_bytes < the_plan.baseline_peak_bytes
        assert [op for op in graph.get_operations() if "recompute" in op.name]


@pytest.mark.slow
@pytest.mark.memory
def test_memory_without_bottleneck_still_saves():
    """A U-Net has no single tensor separating its input from its loss."""
    base, _ = _measure("unet", "tf", image_size=64, batch=8, base=16, levels=4)
    ours, _ = _measure("unet", "memory", image_size=64, batch=8, base=16, levels=4)
    assert ours <= 0.85 * base, (ours / MB, base / MB)


def test_memory_falls_back_with_warning_when_nothing_can_be_saved(graph):
    x = tf.compat.v1.placeholder(tf.float32, [8])
    loss = tf.reduce_sum(x * x)
    before = len(graph.get_operations())
    with pytest.warns(msg.NothingKeptWarning, match="plain tf.gradients"):
        grads = msg.gradients(loss, [x], checkpoints="memory")
    with tf.compat.v1.Session() as session:
        value = session.run(grads[0], {x: np.arange(8, dtype=np.float32)})
    np.testing.assert_allclose(value, 2 * np.arange(8))
    assert len(graph.get_operations()) > before


def test_plan_builds_nothing_and_is_deterministic():
    names = []
    for _ in range(2):
        graph = tf.Graph()
        with graph.as_default():
            model = test_models.build("resnet", depth=20, batch=4)
            count = len(graph.get_operations())
            the_plan = msg.plan(model.loss, model.params)
            assert len(graph.get_operations()) == count
            names.append([t.name for t in the_plan.checkpoints])
    assert names[0] == names[1] and names[0]
    text = str(the_plan)
    assert "checkpoints" in text and "MB" in text and names[0][0] in text
    assert 0 < the_plan.predicted_peak_bytes < the_plan.baseline_peak_bytes
    assert 0 < the_plan.recompute_cost <= 1.5


def test_unknown_batch_dimension_is_an_assumption(graph):
    x = tf.compat.v1.placeholder(tf.float32, [None, 64])
    w = tf.Variable(np.ones([64, 64], np.float32))
    h = x
    for _ in range(8):
        h = tf.tanh(tf.matmul(h, w))
    the_plan = msg.plan(tf.reduce_sum(h), [w])
    assert any("unknown dimensions" in a for a in the_plan.assumptions)
    assert "assumed" in str(the_plan)


def _two_losses_over_one_forward():
    """A GAN's shape: a generator's output fed to a discriminator, two losses."""
    x = tf.compat.v1.placeholder(tf.float32, [32, 64])

    def stack(h, weights):
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
        return h

    g_weights = [tf.Variable(tf.ones([64, 64]) * 0.01) for _ in range(6)]
    d_weights = [tf.Variable(tf.ones([64, 64]) * 0.01) for _ in range(6)]
    fake = stack(x, g_weights)
    d_loss = tf.reduce_mean(stack(fake, d_weights)) + tf.reduce_mean(stack(x, d_weights))
    g_loss = -tf.reduce_mean(stack(fake, d_weights))
    return d_loss, d_weights, g_loss, g_weights


def _says_other_backward(the_plan):
    return any("another backward pass" in a for a in the_plan.assumptions)


@pytest.mark.parametrize("first", ["ours", "tf.gradients"])
def test_a_second_backward_pass_over_one_forward_is_an_assumption(graph, first, caplog):
    """Where the graph already holds the backward pass of another gradient computation
    over the same forward pass (a GAN's two tapes), the plan says its peaks count only
    its own; a plan() after this computation's own gradients() does not."""
    d_loss, d_weights, g_loss, g_weights = _two_losses_over_one_forward()
    assert not _says_other_backward(msg.plan(g_loss, g_weights))
    if first == "ours":
        msg.gradients(d_loss, d_weights, checkpoints="memory")
        assert not _says_other_backward(msg.plan(d_loss, d_weights))
    else:
        tf.compat.v1.gradients(d_loss, d_weights)
    second = msg.plan(g_loss, g_weights)
    assert _says_other_backward(second)
    assert "another backward pass" in str(second)
    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        msg.gradients(g_loss, g_weights, checkpoints="memory")
        msg.gradients(g_loss, g_weights, checkpoints="memory")
    said = [r for r in caplog.records if "another backward pass" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]


def test_a_gradient_penalty_is_part_of_its_own_forward_pass(graph):
    """The inner gradient of a gradient penalty lies inside the outer computation's
    forward pass: no note of another backward pass."""
    x = tf.compat.v1.placeholder(tf.float32, [32, 64])
    weights = [tf.Variable(tf.ones([64, 64]) * 0.01) for _ in range(4)]
    h = x
    for w in weights:
        h = tf.tanh(tf.matmul(h, w))
    (inner,) = tf.compat.v1.gradients(tf.reduce_sum(h), [x])
    loss = tf.reduce_mean(h) + tf.reduce_mean(tf.square(inner))
    assert not _says_other_backward(msg.plan(loss, weights))


@pytest.mark.parametrize("how, side_by_side", [
    ("accumulated", True), ("applied", False), ("applied through a slot", False),
    ("forwards first, then each applied", True)])
def test_micro_batches_tapes_side_by_side_are_an_assumption(how, side_by_side, caplog):
    """Three micro-batches' tapes unrolled in a ``tf.function``.  Where their gradients are
    only accumulated, nothing makes one micro-batch wait for the one before, so the
    second and third plans say that their peaks count only their own pass (a helper's
    trial: four such tapes of a conv net measured 28 MiB against 16.2 planned for each),
    and the log says it once.  Where each micro-batch's update writes the weights the
    next one reads, directly or through an optimizer's slot (a momentum), TensorFlow
    orders them and no plan says so (a reviewer's check: every optimizer with slots got
    the note).  Where every forward pass is built before the first update, the reads
    come before the writes, and nothing orders the passes."""
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.standard_normal((64, 64)).astype("float32") / 8)
               for _ in range(6)]
    slots = [tf.Variable(tf.zeros_like(w)) for w in weights]
    x = tf.constant(rng.standard_normal((3, 256, 64)).astype("float32"))

    def loss_of(tape, i):
        with tape:
            h = x[i]
            for w in weights:
                h = tf.tanh(h @ w)
            return tf.reduce_sum(h * h)

    def update(tape, loss):
        for slot, w, g in zip(slots, weights, tape.gradient(loss, weights)):
            if how == "accumulated":
                slot.assign_add(g)
            elif how == "applied through a slot":
                slot.assign(0.9 * slot + g)
                w.assign_sub(0.01 * slot)
            else:
                w.assign_sub(0.01 * g)

    @tf.function
    def step(x):
        tapes = [tf.GradientTape() for _ in range(3)]
        if how.startswith("forwards first"):
            losses = [loss_of(tape, i) for i, tape in enumerate(tapes)]
            for tape, loss in zip(tapes, losses):
                update(tape, loss)
        else:
            for i, tape in enumerate(tapes):
                losses = [loss_of(tape, i)]
                update(tape, losses[0])
        return losses[-1]

    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        with msg.patched("memory") as handle:
            step.get_concrete_function(x)
    noted = [any("another gradient computation over another forward pass" in a
                 for a in p.assumptions) for p in handle.plans]
    assert noted == [False, side_by_side, side_by_side], [p.assumptions for p in handle.plans]
    said = [r for r in caplog.records if "another forward pass" in r.getMessage()]
    assert len(said) == side_by_side, [r.getMessage() for r in caplog.records]
    assert not any(_says_other_backward(p) for p in handle.plans)


@pytest.mark.parametrize("second_device, side_by_side", [
    ("/device:CPU:1", False), ("/cpu:0", True), ("", True)])
def test_a_backward_pass_on_another_device_is_not_side_by_side(graph, second_device,
                                                                side_by_side):
    """Two independent gradient computations in one v1 graph, the first placed on CPU:0:
    a second one placed on another device (a replica) is not said to run beside it (a
    reviewer's check: a MirroredStrategy's second replica got the note from the first
    one's unplaced proxies); one on the same device, however spelt, or unplaced, is."""
    def chain():
        x = tf.compat.v1.placeholder(tf.float32, [256, 64])
        weights = [tf.Variable(tf.ones([64, 64]) * 0.01) for _ in range(6)]
        h = x
        for w in weights:
            h = tf.tanh(h @ w)
        return tf.reduce_sum(h * h), weights

    with tf.device("/device:CPU:0"):
        loss, weights = chain()
        msg.gradients(loss, weights, checkpoints="memory")
    with tf.device(second_device):
        loss, weights = chain()
    the_plan = msg.plan(loss, weights, checkpoints="memory")
    noted = any("another gradient computation over another forward pass" in a
                for a in the_plan.assumptions)
    assert noted == side_by_side, the_plan.assumptions


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-5, ValueError),
                                        (float("nan"), ValueError), (float("inf"), ValueError),
                                        ("10MB", TypeError), (True, TypeError)])
def test_bad_budget_is_a_clear_error(graph, bad, error):
    """A budget out of range is a ValueError; one that is no number, a TypeError."""
    x = tf.compat.v1.placeholder(tf.float32, [8])
    loss = tf.reduce_sum(tf.tanh(tf.tanh(x)))
    count = len(graph.get_operations())
    with pytest.raises(error, match="memory_budget"):
        msg.gradients(loss, [x], checkpoints="memory", memory_budget=bad)
    assert len(graph.get_operations()) == count


def test_budget_with_other_strategy_is_an_error(graph):
    x = tf.compat.v1.placeholder(tf.float32, [8])
    loss = tf.reduce_sum(tf.tanh(tf.tanh(x)))
    with pytest.raises(ValueError, match="checkpoints='memory'"):
        msg.gradients(loss, [x], checkpoints="speed", memory_budget=1000)


def test_infeasible_budget_states_smallest_peak():
    graph = tf.Graph()
    with graph.as_default():
        model = test_models.build("resnet", depth=20, batch=4)
        count = len(graph.get_operations())
        with pytest.raises(ValueError, match=r"smallest peak .* is [0-9.]+ MB"):
            msg.gradients(model.loss, model.params, checkpoints="memory", memory_budget=10000)
        assert len(graph.get_operations()) == count


# --- measured memory against tf.gradients ---------------------------------

@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.parametrize(
    "name,size,bound",
    [
        ("chain", dict(n=100), 0.30),
        ("resnet", dict(depth=56, batch=8), 0.45),
        ("resnet", dict(depth=110, batch=32), 0.25),
        ("transformer", dict(layers=12, d_model=128, seq_len=128, batch=8), 0.40),
        ("mlp", dict(depth=32, width=256, batch=512), 0.70),
    ],
    ids=["chain100", "resnet56-b8", "resnet110-b32", "gpt12", "mlp32"],
)
def test_memory_strategy_peak_and_plan_accuracy(name, size, bound):
    """Measured peak within the issue's bound; plan() within +-10% for both variants.

    The peak is the least of three traced steps: the executor's inter-op threads
    order independent ops differently from run to run, and plan() models one
    order, the best one.
    """
    base, base_plan = _measure(name, "tf", runs=3, **size)
    ours, our_plan = _measure(name, "memory", runs=3, **size)
    assert ours <= bound * base, f"{ours / MB:.1f} MB vs {base / MB:.1f} MB"
    assert abs(base_plan.baseline_peak_bytes - base) <= 0.10 * base
    assert abs(our_plan.predicted_peak_bytes - ours) <= 0.10 * ours, (
        our_plan.predicted_peak_bytes / MB, ours / MB)


@pytest.mark.slow
@pytest.mark.memory
def test_unet_plan_matches_the_measured_peak():
    """The U-Net's skip connections leave the executor independent branches to
    interleave: plain tf.gradients measured 49.6-65.3 MB from run to run.  'memory'
    releases each recomputed op's gradients together (rewrite.gated_gradients), so its
    peak no longer moves up (27.4-35.1 MB before): plan() within 10% of the least of five
    runs, every run within 2% of the greater of the least and the plan, plain's
    prediction no higher than its most, and 'memory' at most 0.75x of plain at its
    worst.  (In one whole CI run a run measured 25.1 MB, below the 27.1 that every run
    measures alone, against 27.3 planned: a run below the plan is no instability.)"""
    size = dict(levels=4, base=32, image_size=64, batch=8)
    (base_low, base_high), base_plan = _measure("unet", "tf", runs=5, spread=True, **size)
    (low, high), our_plan = _measure("unet", "memory", runs=5, spread=True, **size)
    assert high <= 0.75 * base_high, (high / MB, base_high / MB)
    assert high <= 1.02 * max(low, our_plan.predicted_peak_bytes), (
        low / MB, high / MB, our_plan.predicted_peak_bytes / MB)
    # plain's runs all landed at 64.3 MB in one loaded full-suite run (49.6 in a quiet
    # sweep): only the upper end is a stable bound for the baseline
    assert base_plan.baseline_peak_bytes <= 1.1 * base_high
    assert abs(our_plan.predicted_peak_bytes - low) <= 0.10 * low, (
        our_plan.predicted_peak_bytes / MB, low / MB)


@pytest.mark.slow
@pytest.mark.memory
def test_budget_beats_uniform_on_resnet110():
    """0.22x of the predicted baseline as budget: measured at most 0.25x of tf.gradients."""
    size = dict(depth=110, batch=32)
    base, base_plan = _measure("resnet", "tf", **size)
    ours, _ = _measure("resnet", "memory", memory_budget=0.22 * base_plan.baseline_peak_bytes,
                       **size)
    assert ours <= 0.25 * base, f"{ours / MB:.1f} MB vs {base / MB:.1f} MB"


@pytest.mark.slow
@pytest.mark.memory
def test_budgets_are_met_and_monotone():
    """Budgets of 0.4, 0.6, 0.8 of the baseline: measured peaks within 1.15x, rising
    (within 1%)."""
    size = dict(depth=56, batch=8)
    base, base_plan = _measure("resnet", "tf", **size)
    peaks = []
    for fraction in (0.4, 0.6, 0.8):
        budget = fraction * base_plan.baseline_peak_bytes
        ours, _ = _measure("resnet", "memory", memory_budget=budget, **size)
        assert ours <= 1.15 * budget, (fraction, ours / MB, budget / MB)
        peaks.append(ours)
    # rising; the same plan may serve two budgets (then its peaks differ by jitter only)
    assert peaks[0] <= 1.01 * peaks[1] and peaks[1] <= 1.01 * peaks[2], [p / MB for p in peaks]


def test_strategies_registry():
    assert {"collection", "speed", "memory", "balanced"} <= set(msg.available_strategies())
    with pytest.raises(ValueError, match="Unknown checkpoint strategy"):
        strategies.get("fastest")


def test_copies_nothing_reads_are_not_run(graph):
    """A conv that only feeds a residual add, and the add, are never recomputed."""
    x = tf.compat.v1.placeholder(tf.float32, [2, 8, 8, 4])
    w = tf.Variable(np.ones([3, 3, 4, 4], np.float32))
    p = tf.nn.relu(x)
    h = tf.nn.conv2d(p, w, 1, "SAME")
    out = h + x
    running = graph_lib.copies_that_run([p.op, h.op, out.op])
    assert running == {p.op}  # relu's gradient reads its output; conv reads relu's
    squared = tf.square(out)
    assert graph_lib.copies_that_run([h.op, out.op, squared.op]) == {h.op, out.op}


@pytest.mark.slow
@pytest.mark.parametrize("checkpoints", ["memory", "collection", "speed"])
def test_plan_counts_the_convolutions_a_step_recomputes(checkpoints):
    """plan().recomputed_ops matches what grappler leaves to run: extra Conv2D
    executions of the checkpointed step over plain tf.gradients."""
    ran = {}
    for variant in ("tf", checkpoints):
        graph = tf.Graph()
        with graph.as_default():
            model = test_models.build("resnet", depth=20, batch=4, add_to_collection=True)
            if variant == "tf":
                grads = tf.compat.v1.gradients(model.loss, model.params)
            else:
                the_plan = msg.plan(model.loss, model.params, checkpoints=checkpoints)
                grads = msg.gradients(model.loss, model.params, checkpoints=checkpoints)
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                _, metadata = profiling.traced_run(session, grads, model.feed_dict)
            ran[variant] = profiling.executed_op_types(metadata)
    predicted = dict(the_plan.recomputed_ops)
    assert ran[checkpoints]["Conv2D"] - ran["tf"]["Conv2D"] == predicted.get("Conv2D", 0)
    assert ("Conv2D" in predicted) == (checkpoints != "speed")
    assert "recomputes" in str(the_plan)


def _training_peak(model, checkpoints):
    """Predicted peak as 'memory' judges it: each gradient used as soon as it is made."""
    from memory_saving_gradients import checkpointing, simulate

    problem = checkpointing._prepare(model.loss, _xs(model))
    if not checkpoints:
        return simulate.predict_baseline(problem.region, problem.ys, problem.xs,
                                         fetched=False).peak_bytes
    return simulate.predict_checkpointed(problem.region, problem.ys, problem.xs, checkpoints,
                                         fetched=False).peak_bytes


@pytest.mark.slow
def test_balanced_trades_peak_for_recomputation_within_its_slack(monkeypatch):
    """'balanced' recomputes no more than the least-peak plan, and peaks at most
    MEMORY_SLACK above it; weighing memory above everything gives the least peak."""
    with tf.Graph().as_default():
        model = test_models.build("resnet", depth=56, batch=8)
        default = msg.plan(model.loss, model.params, checkpoints="balanced")
        monkeypatch.setattr(strategies, "MEMORY_WEIGHT", 1e6)
        memo.forget()  # plans are remembered by graph structure: plan again
        try:
            least = msg.plan(model.loss, model.params, checkpoints="balanced")
        finally:
            memo.forget()
        default_peak = _training_peak(model, default.checkpoints)
        least_peak = _training_peak(model, least.checkpoints)
        baseline = _training_peak(model, [])
    assert least_peak <= default_peak
    assert default.recompute_cost <= least.recompute_cost
    assert default_peak <= least_peak + min(strategies.MEMORY_SLACK * least_peak,
                                            strategies.SAVING_SLACK * (baseline - least_peak))


@pytest.mark.slow
@pytest.mark.parametrize("name,size", [
    ("resnet", dict(depth=56, batch=8)),
    ("resnet", dict(depth=110, batch=32)),
    ("transformer", dict(layers=4, d_model=128, seq_len=128, batch=8)),
    ("unet", dict()),
], ids=["resnet56", "resnet110", "gpt4", "unet"])
def test_memory_takes_the_least_peak(monkeypatch, name, size):
    """'memory' predicts within 5% of the least peak the planner finds ('balanced'
    weighing memory above everything), never above 'balanced', and recomputes no
    more than that least-peak plan."""
    with tf.Graph().as_default():
        model = test_models.build(name, **size)
        xs = _xs(model)
        ours = msg.plan(model.loss, xs, checkpoints="memory")
        trade = msg.plan(model.loss, xs, checkpoints="balanced")
        monkeypatch.setattr(strategies, "MEMORY_WEIGHT", 1e6)
        monkeypatch.setattr(strategies, "SCORE_TIE", 0.0)
        memo.forget()  # plans are remembered by graph structure: plan again
        try:
            least = msg.plan(model.loss, xs, checkpoints="balanced")
        finally:
            memo.forget()
        ours_peak, trade_peak, least_peak = (
            _training_peak(model, p.checkpoints) for p in (ours, trade, least))
    assert ours_peak <= (1 + strategies.LEAST_PEAK_TOLERANCE) * least_peak, (
        ours_peak / MB, least_peak / MB)
    assert ours_peak <= trade_peak, (ours_peak / MB, trade_peak / MB)
    assert ours.recompute_cost <= least.recompute_cost + 1e-9


@pytest.mark.slow
def test_memory_peak_grows_as_sqrt_depth_not_as_depth():
    """Predicted training peaks of 'memory' over ResNet depths 20-218 (batch 8): the
    fitted exponent stays near the least peak's sqrt(depth), far from tf.gradients' 1."""
    depths, ours, theirs = [20, 56, 110, 164, 218], [], []
    for depth in depths:
        with tf.Graph().as_default():
            model = test_models.build("resnet", depth=depth, batch=8)
            the_plan = msg.plan(model.loss, model.params, checkpoints="memory")
            ours.append(_training_peak(model, the_plan.checkpoints))
            theirs.append(_training_peak(model, []))
    ours_exponent = np.polyfit(np.log(depths), np.log(ours), 1)[0]
    theirs_exponent = np.polyfit(np.log(depths), np.log(theirs), 1)[0]
    assert theirs_exponent >= 0.9, theirs_exponent
    assert ours_exponent <= 0.6, (ours_exponent, [p / MB for p in ours])


def test_planning_restores_the_garbage_collector_state():
    """The planner pauses Python's cyclic GC while it runs and leaves it as it found it."""
    import gc

    with tf.Graph().as_default():
        model = test_models.build("resnet", depth=8, batch=2)
        assert gc.isenabled()
        msg.plan(model.loss, model.params, checkpoints="memory")
        assert gc.isenabled()
        gc.disable()
        try:
            msg.gradients(model.loss, model.params, checkpoints="memory")
            assert not gc.isenabled()
        finally:
            gc.enable()


@pytest.mark.unit
def test_a_budget_weighs_the_fine_grids_plans_too(monkeypatch):
    """With tens of checkpoints, the dynamic program's coarse grid of kept bytes rounds
    a good part of the budget away; weighing the fine grid's proposals as well finds a
    plan that fits the same budget and recomputes less (ResNet-110, batch 32, 48 MB)."""
    from memory_saving_gradients._units import MIB

    with tf.Graph().as_default():
        model = test_models.resnet.build(depth=110, batch=32)
        xs = _xs(model)
        both = msg.plan(model.loss, xs, checkpoints="memory", memory_budget=48 * MIB)
        monkeypatch.setattr(strategies, "BUDGET_LEVELS", strategies.BUDGET_LEVELS[:1])
        memo.forget()  # plans are remembered by graph structure: plan again
        coarse = msg.plan(model.loss, xs, checkpoints="memory", memory_budget=48 * MIB)
    assert both.predicted_peak_bytes <= 48 * MIB and coarse.predicted_peak_bytes <= 48 * MIB
    assert both.recompute_cost < coarse.recompute_cost - 0.03, (both, coarse)


@pytest.mark.keras
def test_memory_keeps_nothing_where_the_least_peak_is_within_its_tolerance_of_plain(monkeypatch):
    """A Keras LSTM's last output into four dense layers, batch 512: the least peak
    the planner finds is 1% under plain's (it rewrote, recomputing half a forward pass,
    and measured 29.5 MB against plain's 29.25). Plain tf.gradients is near the least
    peak and recomputes nothing, so 'memory' and 'balanced' keep nothing and say why."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 32))
    h = keras.layers.LSTM(128)(inputs)
    for _ in range(4):
        h = keras.layers.Dense(128, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))

    def plan(strategy):
        plans = []

        @tf.function
        def step(x):
            loss = tf.reduce_mean(model(x) ** 2)
            plans.append(msg.plan(loss, model.trainable_variables, checkpoints=strategy))
            return loss

        step.get_concrete_function(tf.TensorSpec([512, 16, 32]))
        return plans[0]

    for strategy in ("memory", "balanced"):
        with pytest.warns(msg.NothingKeptWarning, match="by more than 5% below plain"):
            assert not plan(strategy).checkpoints
    monkeypatch.setattr(strategies, "LEAST_PEAK_TOLERANCE", 0.0)
    memo.forget()
    without_tolerance = plan("memory")
    memo.forget()  # that plan was made with the tolerance patched away
    assert without_tolerance.checkpoints, "the check needs a plan that saves a little"
    assert 0.95 < without_tolerance.in_step_ratio < 1.0, str(without_tolerance)


def _conv_bn_relu_loss(batch):
    """Eight 3x3 conv (32 channels) - batch norm (training) - ReLU layers at 32 px, a
    mean-pooled dense head; ``batch`` None for an unknown batch."""
    rng = np.random.default_rng(0)
    x = tf.compat.v1.placeholder(tf.float32, [batch, 32, 32, 3])
    h, weights, channels = x, [], 3
    for _ in range(8):
        weights.append(tf.Variable(rng.normal(size=(3, 3, channels, 32)).astype(np.float32) / 10))
        channels = 32
        h = tf.nn.conv2d(h, weights[-1], 1, "SAME")
        mean, variance = tf.nn.moments(h, [0, 1, 2])
        h = tf.nn.relu(tf.nn.batch_normalization(h, mean, variance, None, None, 1e-3))
    weights.append(tf.Variable(rng.normal(size=(32, 10)).astype(np.float32) / 10))
    return tf.reduce_mean(tf.reduce_mean(h, [1, 2]) @ weights[-1]), weights


def test_memory_at_a_known_batch_is_no_worse_than_the_plan_for_every_batch(graph):
    """The program's coarse model of a segment's bytes kept a cut that the simulation
    finds costs more than it saves at a small batch, where weights weigh as much as
    activations: eight conv-BN-ReLU layers at a known batch 8 were planned at 9.04 MB,
    while the same graph with its batch unknown got a plan of 8.18 MB at batch 8, and a
    budget between the two raised "cannot be met" (a helper's trial, Keras).  The plan
    of least peak found tries dropping each of its cuts (``_Proposals.without_a_cut``):
    at the known batch the 'memory' plan peaks no higher than the plan for every batch
    there, and a budget at that peak is met."""
    known, weights = _conv_bn_relu_loss(8)
    at_eight = msg.plan(known, weights, checkpoints="memory")
    unknown, unknown_weights = _conv_bn_relu_loss(None)
    for_every_batch = msg.plan(unknown, unknown_weights, checkpoints="memory")
    assert at_eight.checkpoints and for_every_batch.checkpoints
    assert at_eight.predicted_peak_bytes <= for_every_batch.peak_at(8), (
        str(at_eight), for_every_batch.peak_at(8))
    budgeted = msg.plan(known, weights, checkpoints="memory",
                        memory_budget=for_every_batch.peak_at(8))
    assert budgeted.predicted_peak_bytes <= for_every_batch.peak_at(8)


def test_a_budget_at_the_memory_plans_peak_is_met(graph):
    """The 'memory' plan (made without the gradients fetched, its cuts dropped where that
    lowers the simulated peak) can simulate lower with them fetched than anything a
    budget's search proposes: eight conv-BN-ReLU layers at batch 1 were planned by
    'memory' at 1,140,736 bytes, and a budget at that figure, or 5% above it, raised
    "cannot be met: the smallest peak ... 1,198,080" (a helper's review).  A budget at
    'memory''s predicted peak is met, by a plan at or under it."""
    loss, weights = _conv_bn_relu_loss(1)
    least = msg.plan(loss, weights, checkpoints="memory")
    assert least.checkpoints
    budgeted = msg.plan(loss, weights, checkpoints="memory",
                        memory_budget=least.predicted_peak_bytes)
    assert budgeted.predicted_peak_bytes <= least.predicted_peak_bytes, (str(budgeted), str(least))


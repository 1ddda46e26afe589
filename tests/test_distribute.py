"""tf.distribute.MirroredStrategy over two logical CPUs.

``memory_saving_gradients.gradients`` is called per replica inside
``strategy.run`` in a ``tf.function``.  Logical CPUs must be configured before
TensorFlow initializes its devices, so everything runs in a child process
(this file run as a script) that prints JSON; the tests assert on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

LAYERS = 8
WIDTH = 64
BATCH = 16  # global batch: 8 examples per replica
STEPS = 4
LR = 0.5


@pytest.fixture(scope="module")
def measured() -> dict:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_replicas(measured):
    assert measured["replicas"] == 2
    assert measured["replica_devices"] == ["CPU:0", "CPU:1"]


def test_per_replica_gradients_equal_tf_gradients_and_tape(measured):
    # Each replica sees different examples, so its gradients differ.
    assert measured["replica_grads_differ"] > 1e-4
    assert measured["max_diff_vs_tf_gradients"] < 1e-6
    assert measured["max_diff_vs_tape"] < 1e-6


def test_recomputed_ops_run_on_their_replica_device(measured):
    assert measured["copies_by_device"].keys() == {"CPU:0", "CPU:1"}
    assert measured["copies_by_device"]["CPU:0"] == measured["copies_by_device"]["CPU:1"] > 0
    assert measured["copies_without_replica_device"] == 0


def test_training_steps_give_the_same_losses(measured):
    ours, theirs = measured["losses"], measured["baseline_losses"]
    assert len(ours) == STEPS
    assert ours[-1] < ours[0]  # it trains
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (ours, theirs)


def test_tape_patch_in_replica_function_trains_like_the_plain_tape(measured):
    assert measured["tape_patch_copies"] > 0
    ours, theirs = measured["tape_patch_losses"], measured["tape_patch_baseline"]
    assert ours[-1] < ours[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


@pytest.mark.keras
def test_keras_fit_under_mirrored_strategy_with_enable(measured):
    np.testing.assert_allclose(measured["keras_losses"], measured["keras_baseline"], rtol=1e-5)


# ----------------------------------------------------------------- child process


def _main() -> None:
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    import memory_saving_gradients as msg

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.RandomState(0)
    init = [rng.standard_normal([WIDTH, WIDTH]).astype(np.float32) * 0.3 for _ in range(LAYERS)]
    data = rng.standard_normal([BATCH, WIDTH]).astype(np.float32)
    with strategy.scope():
        ours = [tf.Variable(w, name=f"ours{i}") for i, w in enumerate(init)]
        theirs = [tf.Variable(w, name=f"theirs{i}") for i, w in enumerate(init)]
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(data).batch(BATCH))))

    def forward(weights, x):
        h, units = x, []
        for w in weights:  # two tanhs a layer: keeping the matmuls ('speed') then saves memory
            h = tf.tanh(tf.tanh(tf.matmul(h, w)))
            units.append(h)
        return tf.reduce_mean(tf.square(h)), units

    def compare(x):
        with tf.GradientTape() as tape:
            loss, units = forward(ours, x)
        checkpointed = msg.gradients(loss, ours, checkpoints=units[1::3])
        plain = tf.compat.v1.gradients(loss, ours)
        taped = tape.gradient(loss, ours)
        return checkpointed, plain, taped

    @tf.function
    def compare_fn(x):
        return strategy.run(compare, args=(x,))

    def train_step(weights, use_ours, x):
        loss, units = forward(weights, x)
        if use_ours:
            grads = msg.gradients(loss, weights, checkpoints=units[1::3])
        else:
            grads = tf.compat.v1.gradients(loss, weights)
        ctx = tf.distribute.get_replica_context()
        grads = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, grads)
        for w, g in zip(weights, grads):
            w.assign_sub(LR * g)
        return loss

    @tf.function
    def train_fn(x):
        a = strategy.run(train_step, args=(ours, True, x))
        b = strategy.run(train_step, args=(theirs, False, x))
        mean = tf.distribute.ReduceOp.MEAN
        return strategy.reduce(mean, a, axis=None), strategy.reduce(mean, b, axis=None)

    checkpointed, plain, taped = compare_fn(batch)
    local = strategy.experimental_local_results
    diff_tf = diff_tape = 0.0
    per_replica = []
    for c, p, t in zip(checkpointed, plain, taped):
        cs = [v.numpy() for v in local(c)]
        per_replica.append(cs)
        for cv, pv, tv in zip(cs, local(p), local(t)):
            diff_tf = max(diff_tf, float(np.max(np.abs(cv - pv.numpy()))))
            diff_tape = max(diff_tape, float(np.max(np.abs(cv - tv.numpy()))))
    replica_diff = max(float(np.max(np.abs(a - b))) for a, b in per_replica)

    graph = compare_fn.get_concrete_function(batch).graph
    by_device: dict = {}
    without = 0
    for op in graph.get_operations():
        if op.type == "Tanh" and "recompute" in op.name:
            suffix = op.device.upper()[-5:]
            if suffix not in ("CPU:0", "CPU:1"):
                without += 1
            else:
                by_device[suffix] = by_device.get(suffix, 0) + 1

    losses, baseline = [], []
    for _ in range(STEPS):
        a, b = train_fn(batch)
        losses.append(float(a))
        baseline.append(float(b))

    # The tape-level patch: a plain tf.GradientTape in the replica function.
    with strategy.scope():
        tape_ours = [tf.Variable(w, name=f"tape_ours{i}") for i, w in enumerate(init)]
        tape_theirs = [tf.Variable(w, name=f"tape_theirs{i}") for i, w in enumerate(init)]

    def tape_step(weights, x):
        with tf.GradientTape() as tape:
            loss, units = forward(weights, x)
        for t in units[1::3]:
            tf.compat.v1.add_to_collection("checkpoints", t)
        grads = tape.gradient(loss, weights)
        grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, grads)
        for w, g in zip(weights, grads):
            w.assign_sub(LR * g)
        return loss

    def tape_fn(weights):
        @tf.function
        def run(x):
            loss = strategy.run(tape_step, args=(weights, x))
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, loss, axis=None)
        return run

    plain_tape_fn = tape_fn(tape_theirs)
    # 'collection' (every third layer's output): at 8 examples per replica the weights'
    # gradients make the peak, so 'memory' and 'speed' rightly find nothing worth
    # recomputing here.
    with msg.patched("collection"):
        patched_tape_fn = tape_fn(tape_ours)
        patched_graph = patched_tape_fn.get_concrete_function(batch).graph
    tape_copies = sum(
        "recompute" in op.name for op in patched_graph.get_operations() if op.type == "Tanh"
    )
    tape_losses, tape_baseline = [], []
    for _ in range(STEPS):
        tape_losses.append(float(patched_tape_fn(batch)))
        tape_baseline.append(float(plain_tape_fn(batch)))

    # Keras 3 fit under the strategy, with keras.enable.
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    def keras_losses(enable):
        keras.utils.set_random_seed(4)
        with strategy.scope():
            stack = [keras.Input((WIDTH,))]
            stack += [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(LAYERS)]
            model = keras.Sequential(stack + [keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        if enable:
            msg.keras.enable(model, batch_size=BATCH // 2)
        targets = data[:, :1] * 0.5
        history = model.fit(data, targets, batch_size=BATCH, epochs=STEPS, shuffle=False,
                            verbose=0)
        return history.history["loss"]

    print(json.dumps(dict(
        tape_patch_copies=tape_copies,
        tape_patch_losses=tape_losses,
        tape_patch_baseline=tape_baseline,
        keras_losses=keras_losses(True),
        keras_baseline=keras_losses(False),
        replicas=strategy.num_replicas_in_sync,
        replica_devices=[d.upper()[-5:] for d in strategy.extended.worker_devices],
        replica_grads_differ=replica_diff,
        max_diff_vs_tf_gradients=diff_tf,
        max_diff_vs_tape=diff_tape,
        copies_by_device=by_device,
        copies_without_replica_device=without,
        losses=losses,
        baseline_losses=baseline,
    )))


if __name__ == "__main__":
    _main()

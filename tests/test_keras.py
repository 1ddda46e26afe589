"""Keras 3 (TensorFlow backend): memory_saving_gradients.keras.enable(model).

``fit`` must train exactly as without it (batch norm, dropout), the step
Keras builds must really contain recompute copies, and a deep net's process
peak RSS must drop (measured in separate processes with ``VmHWM``,
running ``examples/keras_fit.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import memory_saving_gradients as msg  # noqa: E402
from memory_saving_gradients import tape as tape_lib  # noqa: E402

pytestmark = pytest.mark.keras

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "keras_fit.py")


def _data(batch=512, inputs=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, inputs)).astype("float32")
    y = (x[:, :1] - 0.5 * x[:, 1:2] + 0.1 * x[:, 2:3] ** 2).astype("float32")
    return x, y


def _model(dropout: float, blocks: int = 6, width: int = 32, inputs: int = 16):
    keras.utils.set_random_seed(1)
    stack = [keras.Input((inputs,))]
    for _ in range(blocks):
        stack += [keras.layers.Dense(width), keras.layers.BatchNormalization(),
                  keras.layers.Activation("relu")]
        if dropout:
            stack.append(keras.layers.Dropout(dropout))
    model = keras.Sequential(stack + [keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse",
                  metrics=["mae"])
    return model


def _fit(model, steps=4):
    x, y = _data()
    # one batch per epoch: the history is the loss of each step
    history = model.fit(x, y, batch_size=len(x), epochs=steps, shuffle=False, verbose=0)
    return history.history


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fit_trains_like_keras_with_batch_norm_and_dropout(dropout, recorded_graphs):
    plain = _model(dropout)
    want = _fit(plain)
    ours = msg.keras.enable(_model(dropout), checkpoints="memory")
    got = _fit(ours)

    assert recorded_graphs, "fit() did not go through memory_saving_gradients.GradientTape"
    copies = [op for g in recorded_graphs for op in g.get_operations() if "recompute" in op.name]
    assert copies, "the train step Keras built has no recompute copies"
    assert {op.type for op in copies} & {"MatMul", "Relu", "_FusedMatMul", "BiasAdd", "AddV2",
                                          "Mul", "Sub", "Rsqrt"}, {op.type for op in copies}
    # Same seeds, same data: the same trajectory (dropout masks included).
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-4)
    np.testing.assert_allclose(got["mae"], want["mae"], rtol=2e-4)
    assert got["loss"][-1] < got["loss"][0]
    # Batch norm's moving statistics were updated, as in plain Keras.
    for a, b in zip(ours.non_trainable_weights, plain.non_trainable_weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_enable_reaches_a_custom_train_step_and_refuses_tensor_lists(recorded_graphs):
    """A model's own train_step with tf.GradientTape is checkpointed too."""
    import tensorflow as tf

    class Custom(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((16,))
        h = inputs
        for _ in range(4):
            h = keras.layers.Dense(32, activation="tanh")(h)
        model = Custom(inputs, keras.layers.Dense(1)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        return model

    want = _fit(build(), steps=3)
    got = _fit(msg.keras.enable(build()), steps=3)
    assert recorded_graphs, "the custom train_step's tape did not go through the library"
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    with pytest.raises(TypeError, match="strategy name"):
        msg.keras.enable(_model(0.0, blocks=1), checkpoints=[])
    with pytest.raises(TypeError, match="patch"):
        msg.keras.enable(object())


@pytest.mark.slow
def test_disable_restores_keras_train_step(recorded_graphs):
    model = msg.keras.enable(_model(0.0, blocks=2), checkpoints="memory")
    assert msg.keras.is_enabled(model)
    msg.keras.disable(model)
    assert not msg.keras.is_enabled(model)
    assert "train_step" not in model.__dict__
    _fit(model, steps=1)
    assert not recorded_graphs


def _run_example(*args) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    return subprocess.Popen(
        [sys.executable, EXAMPLE, "--json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )


def _result(proc) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.memory
def test_deep_fit_peak_rss_drops_by_200_mb():
    """48 x Dense(1024), batch 4096, one step, in two processes (ours then evaluates).

    Both processes run at once (peak RSS is per process); each activation is
    16 MiB, so plain Keras keeps ~1.5 GiB of them.
    """
    start = time.perf_counter()
    size = ["--layers", "48", "--width", "1024", "--batch", "4096", "--steps", "1"]
    plain_proc = _run_example(*size, "--plain", "--no-eval")
    ours_proc = _run_example(*size, "--checkpoints", "memory")
    plain, ours = _result(plain_proc), _result(ours_proc)
    seconds = time.perf_counter() - start
    saved = plain["peak_rss_mib"] - ours["peak_rss_mib"]
    print(f"peak RSS: plain {plain['peak_rss_mib']:.0f} MiB, enable() "
          f"{ours['peak_rss_mib']:.0f} MiB, saved {saved:.0f} MiB; "
          f"fit {plain['fit_seconds']:.1f} s vs {ours['fit_seconds']:.1f} s, process CPU "
          f"{plain['cpu_seconds']:.0f} s vs {ours['cpu_seconds']:.0f} s (ours evaluates too); "
          f"test took {seconds:.0f} s")
    assert saved * 2**20 >= 200e6, (plain, ours)
    # The step trained: the loss after it is lower than before it, as in plain Keras.
    assert ours["final_loss"] < ours["losses"][0]
    np.testing.assert_allclose(ours["losses"], plain["losses"], rtol=1e-4)


def test_run_eagerly_trains_and_warns_once():
    tape_lib._eager_warned.clear()
    plain = _model(0.0, blocks=2)
    want = _fit(plain, steps=2)
    model = _model(0.0, blocks=2)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse",
                  metrics=["mae"], run_eagerly=True)
    msg.keras.enable(model, checkpoints="memory")
    with pytest.warns(msg.EagerExecutionWarning, match="run_eagerly") as caught:
        got = _fit(model, steps=2)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-4)
    assert len([w for w in caught if w.category is msg.EagerExecutionWarning]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_patched_fit_on_tf_data_trains_like_keras(steps_per_execution, recorded_graphs):
    """The one line for a TF2 user: `with patched():` around fit on a tf.data pipeline
    batched without drop_remainder (batch dimension None, a partial last batch)."""
    import tensorflow as tf

    x, y = _data(batch=200)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)  # 64, 64, 64, 8

    def run(patch):
        model = _model(0.3)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse",
                      steps_per_execution=steps_per_execution)
        if patch:
            with msg.patched("memory"):
                return model.fit(data, epochs=2, verbose=0).history["loss"]
        return model.fit(data, epochs=2, verbose=0).history["loss"]

    want = run(False)
    got = run(True)
    assert recorded_graphs, "fit() did not go through the library"
    assert any(
        "recompute" in op.name for g in recorded_graphs for op in g.get_operations()
    ), "the planner kept nothing in fit's step"
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _dropout_net(kind: str):
    """A Keras 3 net with a ``Dropout`` after every layer (its mask made in the step from
    a seed variable) and its batch: six conv-ReLU layers of 32 channels at 32 px after a
    ``Rescaling`` (batch 32), or eight ``Dense(512)`` ReLU layers (batch 512)."""
    keras.utils.set_random_seed(0)
    if kind == "conv":
        shape, batch = (32, 32, 3), 32
        stack = [keras.Input(shape), keras.layers.Rescaling(1 / 255)]
        for _ in range(6):
            stack += [keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                      keras.layers.Dropout(0.2)]
        stack.append(keras.layers.GlobalAveragePooling2D())
    else:
        shape, batch = (512,), 512
        stack = [keras.Input(shape)]
        for _ in range(8):
            stack += [keras.layers.Dense(512, activation="relu"), keras.layers.Dropout(0.3)]
    model = keras.Sequential(stack + [keras.layers.Dense(10)])
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch,) + shape).astype("float32")
    return model, x, rng.integers(0, 10, batch)


def _train_on_batch_peak(model, x, y) -> float:
    """Least allocator peak (MiB) of three ``train_on_batch`` steps after a warm-up one."""
    import tensorflow as tf

    x, y = tf.constant(x), tf.constant(y)
    model.train_on_batch(x, y)
    return min(msg.peak_memory_during(lambda: model.train_on_batch(x, y))
               for _ in range(3)) / (1 << 20)


def _dropout_figures() -> dict:
    """``{kind: figures}`` of both dropout nets: measured (least of three steps) and
    planned in-step peaks in MiB, plain and ``'memory'``, and the plan's summary."""
    figures = {}
    for kind in ("conv", "mlp"):
        model, x, y = _dropout_net(kind)
        plain = _train_on_batch_peak(model, x, y)
        model, x, y = _dropout_net(kind)
        ours = _train_on_batch_peak(msg.keras.enable(model, "memory"), x, y)
        plan = msg.keras.plans(model)[-1]
        figures[kind] = {
            "plain": plain, "ours": ours, "plan": str(plan),
            "planned_plain": plan.in_step_baseline_peak_bytes / (1 << 20),
            "planned_ours": plan.in_step_peak_bytes / (1 << 20),
        }
    return figures


@pytest.fixture(scope="module")
def dropout_figures() -> dict:
    """The dropout nets measured in a fresh process.  In the process that has run the
    suite before them, the CPU allocator's in-use peak of the same steps read 6-8 MB
    higher (conv net: plain 63.8 against 55.0-57.6 MB, ``'memory'`` 38.1 against
    29.4-32.0; the MLP 1.5-1.8 MB higher), with the same plans: the measurement, not
    the model, depends on what ran before."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "dropout-figures"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.memory
@pytest.mark.parametrize("kind", ["conv", "mlp"])
def test_plan_of_a_dropout_net_is_what_the_step_measures(kind, dropout_figures):
    """Keras 3's ``Dropout`` makes its mask in the step, from a seed variable: the memory
    model counts it from the step's start to its gradient.  ``train_on_batch`` applies
    each gradient as it is made, so the plan's in-step peaks are the ones to compare:
    within 10% of the measured ones, plain and ``'memory'``.  Before the masks were
    counted: the conv net's ``'memory'`` plan was predicted 24.0 MB and measured 33.0
    (now 30.4 and 29.4-32.0, plain 58.4 against 55.0-57.6); the MLP's 8.0 against
    9.8-10.5 (now 9.8 against 9.8-10.3), its plain 17.0 against 19.0-20.0 (now 19.0)."""
    figures = dropout_figures[kind]
    plain, ours = figures["plain"], figures["ours"]
    assert abs(figures["planned_plain"] / plain - 1) <= 0.1, figures
    assert abs(figures["planned_ours"] / ours - 1) <= 0.1, figures
    assert ours < 0.8 * plain, figures


if __name__ == "__main__" and sys.argv[1:] == ["dropout-figures"]:
    print(json.dumps(_dropout_figures()))


@pytest.mark.memory
def test_a_quantized_model_saves_at_a_large_batch():
    """A Keras int8-quantized MLP (``model.quantize('int8')``: each Dense a
    ``tf.custom_gradient`` whose closure reads its arguments), trained with ``fit`` on a
    ``tf.data`` pipeline of batch 4096 (``None`` in the graph): 'memory' keeps
    checkpoints, the losses are plain's, and the step's allocator peak is below plain's
    (8.25 MiB against 12.0 on this machine, 0.70x predicted).  It kept nothing before:
    the model took the ops inside each custom gradient for ops whose gradients read
    their outputs, so each recomputed segment seemed to hold them all again."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(8192, 64)).astype("float32"),
         rng.integers(0, 4, size=(8192,)))).batch(4096)

    def quantized():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        h = inputs
        for _ in range(8):
            h = keras.layers.Dense(64, activation="tanh")(h)
        model = keras.Model(inputs, keras.layers.Dense(4)(h))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras' own notes on quantizing
            model.quantize("int8")
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    plain_model, our_model = quantized(), quantized()
    plain_losses = plain_model.fit(data, epochs=2, verbose=0).history["loss"]
    with msg.patched("memory") as handle:
        our_losses = our_model.fit(data, epochs=2, verbose=0).history["loss"]
    assert handle.plans and handle.plans[0].checkpoints, handle.plans
    np.testing.assert_allclose(our_losses, plain_losses, rtol=1e-5)
    plain = min(msg.peak_memory_during(lambda: plain_model.fit(data, verbose=0))
                for _ in range(2))
    ours = min(msg.peak_memory_during(lambda: our_model.fit(data, verbose=0)) for _ in range(2))
    assert ours <= 0.85 * plain, (ours / 2**20, plain / 2**20, str(handle.plans[0]))


@pytest.mark.unit
def test_checkpoints_that_do_not_separate_a_branchy_net_are_said_to_recompute_much(caplog):
    """keras.applications InceptionV3 (75 px, batch 4) with every 10th layer's output as
    checkpoints: most lie inside a block's branches, so each kept tensor's segment
    reaches back across blocks and the segments overlap: 12,635 copies of its 1,822
    ops, 6.9 times (a helper's trial, thirty-first session: its first call took 131 s
    against 13.5 s plain, NASNetMobile's 742 s). One WARNING says so before anything
    is built; 'memory' (0.9 times) says nothing."""
    import logging

    import tensorflow as tf

    from memory_saving_gradients import checkpointing
    from memory_saving_gradients import schedule as schedule_lib

    keras.utils.set_random_seed(0)
    model = keras.applications.InceptionV3(weights=None, input_shape=(75, 75, 3), classes=10)
    listed = keras.Model(model.inputs, [layer.output for layer in model.layers[1:-1:10]]
                         + [model.output])
    said = {}

    def forward(t):
        while t.op.type == "Identity" and t.op.inputs:
            t = t.op.inputs[0]
        return t

    @tf.function(autograph=False)  # the library's private functions, not converted
    def step(x, y):
        *kept, prediction = listed(x, training=True)
        loss = keras.losses.SparseCategoricalCrossentropy()(y, prediction)
        problem = checkpointing._prepare(loss, model.trainable_variables)
        memory = checkpointing.choose_checkpoints(
            "memory", problem.ys, problem.xs, problem.region, problem.graph)
        for name, checkpoints in (("memory", memory), ("list", [forward(t) for t in kept])):
            caplog.clear()
            schedule = schedule_lib.backward_schedule(
                problem.region, problem.ys, problem.xs, checkpoints)
            with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
                checkpointing._warn_if_recomputing_much(schedule, problem.region)
            said[name] = [r.getMessage() for r in caplog.records
                          if r.name == "memory_saving_gradients"]
        return loss

    step.get_concrete_function(tf.TensorSpec([4, 75, 75, 3]), tf.TensorSpec([4], tf.int32))
    assert said["memory"] == [], said
    assert len(said["list"]) == 1 and re.search(
        r"recompute \d+ ops, (\d+\.\d) times the \d+ between xs and ys", said["list"][0]), said
    assert float(re.search(r"(\d+\.\d) times", said["list"][0]).group(1)) > 3, said

"""tf.function(jit_compile=True): gradients are correct, and what XLA does with the recomputation.

Measured on CPU (TF 2.21): the graph TensorFlow hands to XLA holds the
recomputed copies (twice the forward ops), but XLA's common-subexpression
elimination merges each copy with the original it copies (the control
inputs that order the copies are not data, and XLA drops them), so the
optimized HLO has exactly the ops of plain ``tf.gradients``, and XLA's buffer
assignment gives the same temporary memory: under XLA the rewrite saves
nothing (and costs nothing).  These tests pin that down; if a later XLA keeps
the recomputation they fail, and README.md must be updated.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import memory_saving_gradients as msg

LAYERS = 12
WIDTH = 128
BATCH = 256


def _weights(seed=0):
    rng = np.random.RandomState(seed)
    ws = [(rng.standard_normal([WIDTH, WIDTH]) / np.sqrt(WIDTH)).astype(np.float32)
          for _ in range(LAYERS)]
    x = rng.standard_normal([BATCH, WIDTH]).astype(np.float32)
    return x, ws


def _forward(x, ws):
    h, units = x, []
    for w in ws:
        h = tf.tanh(tf.matmul(h, w))
        units.append(h)
    return tf.reduce_sum(h * h), units


def _function(mode, jit, ws):
    @tf.function(jit_compile=jit)
    def grads(x):
        loss, units = _forward(x, ws)
        if mode == "plain":
            return tf.compat.v1.gradients(loss, ws)
        if mode == "list":
            return msg.gradients(loss, ws, checkpoints=units[2::3])
        return msg.gradients(loss, ws, checkpoints=mode)
    return grads


MODES = ["list"] + [s for s in ("memory", "speed") if s in msg.available_strategies()]


@pytest.fixture(scope="module")
def setup():
    x_value, w_values = _weights()
    ws = [tf.Variable(w) for w in w_values]
    x = tf.constant(x_value)
    reference = [g.numpy() for g in _function("plain", False, ws)(x)]
    return x, ws, reference


@pytest.mark.parametrize("mode", MODES)
def test_gradients_under_jit_compile_equal_tf_gradients(setup, mode):
    x, ws, reference = setup
    xla_plain = [g.numpy() for g in _function("plain", True, ws)(x)]
    ours = [g.numpy() for g in _function(mode, True, ws)(x)]
    for a, b, c in zip(ours, xla_plain, reference):
        scale = float(np.max(np.abs(c)))
        assert np.max(np.abs(a - b)) <= 1e-5 * scale
        assert np.max(np.abs(a - c)) <= 1e-4 * scale


def test_rewrite_happens_when_traced_for_xla(setup):
    """get_concrete_function/experimental_get_compiler_ir trace a jit_compile function in
    an XLA context; that is not control flow, so the forward is still recomputed."""
    x, ws, _ = setup
    graph = _function("list", True, ws).get_concrete_function(x).graph
    copies = [op for op in graph.get_operations() if "/recompute_" in op.name and op.type == "Tanh"]
    assert len(copies) >= LAYERS // 2


def _count(hlo: str, op: str) -> int:
    return len(re.findall(rf"\s{op}\(", hlo))


def test_xla_merges_the_recomputation_away(setup):
    x, ws, _ = setup
    ours = _function("list", True, ws)
    plain = _function("plain", True, ws)
    ours_hlo = ours.experimental_get_compiler_ir(x)(stage="hlo")
    plain_hlo = plain.experimental_get_compiler_ir(x)(stage="hlo")
    # What TensorFlow hands to XLA: the copies are there.
    assert _count(plain_hlo, "tanh") == LAYERS
    assert _count(ours_hlo, "tanh") >= LAYERS + LAYERS // 2
    ours_opt = ours.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    plain_opt = plain.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    # After XLA's optimizations: the same ops as plain tf.gradients.
    assert _count(ours_opt, "tanh") == _count(plain_opt, "tanh") == LAYERS
    assert _count(ours_opt, "dot") == _count(plain_opt, "dot")


def test_xs_may_be_captured_eager_tensors():
    """xs that a tf.function captures (eager constants), with and without XLA, as tf.gradients."""
    x_value, w_values = _weights(1)
    ws = [tf.constant(w) for w in w_values]
    x = tf.constant(x_value)
    reference = [g.numpy() for g in _function("plain", False, ws)(x)]
    for jit in (False, True):
        ours = [g.numpy() for g in _function("list", jit, ws)(x)]
        for a, b in zip(ours, reference):
            assert np.max(np.abs(a - b)) <= 1e-4 * float(np.max(np.abs(b)))


def test_xla_buffer_assignment_is_the_same():
    """XLA's own memory report (CPU): temporary bytes with the rewrite equal plain's."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), tmp],
            capture_output=True, text=True, timeout=180, env=env,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    activation = BATCH * WIDTH * 4
    plain, ours = result["plain"], result["list"]
    # Plain keeps every activation; so does XLA with the rewrite.
    assert plain >= LAYERS * activation, result
    assert abs(ours - plain) <= 0.05 * plain, result


# ----------------------------------------------------------------- child process


def _temp_bytes(dump_dir: str, before: set) -> int:
    """Preallocated temp bytes from the newest XLA memory-usage report in ``dump_dir``."""
    reports = [f for f in os.listdir(dump_dir)
               if f.endswith("memory-usage-report.txt") and "XlaMustCompile_true" in f
               and f not in before]
    assert len(reports) == 1, reports
    with open(os.path.join(dump_dir, reports[0])) as f:
        text = f.read()
    sizes = [int(m) for m in re.findall(r"allocation \d+: size (\d+), preallocated-temp", text)]
    if not sizes:  # sizes printed with units
        units = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}
        sizes = [int(float(v) * units[u]) for v, u in
                 re.findall(r"allocation \d+: size ([\d.]+)(B|KiB|MiB|GiB), preallocated-temp", text)]
    return max(sizes, default=0)


def _main(dump_dir: str) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir}").strip()
    x_value, w_values = _weights()
    ws = [tf.constant(w) for w in w_values]
    x = tf.constant(x_value)
    result = {}
    for mode in ("plain", "list"):
        before = set(os.listdir(dump_dir))
        _function(mode, True, ws)(x)
        result[mode] = _temp_bytes(dump_dir, before)
    print(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])

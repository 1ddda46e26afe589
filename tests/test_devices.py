"""Several devices: a model split over two logical CPUs.

Logical devices must be configured before TensorFlow initializes its
devices, which in a pytest process has long happened, so the measurements
run in a child process (this file run as a script) that prints JSON; the
tests assert on it.

Model: a tanh chain of 2 x 16 ops on 1 MiB vectors, the first half on
/cpu:0 and the second on /cpu:1, checkpoints every 4th activation.  A plain
backward pass keeps all 16 activations of each half (16 MiB per device); the
rewrite keeps 4 checkpoints per half and recomputes 3 activations at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.memory, pytest.mark.slow]

HALF = 16
SIZE = 262144  # float32 elements: 1 MiB
EVERY = 4


def _child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


@pytest.fixture(scope="module")
def measured() -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__)],
        capture_output=True, text=True, timeout=240, env=_child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_copies_run_on_the_device_of_the_op_they_copy(measured):
    for colocate in ("False", "True"):
        result = measured[colocate]
        assert result["copies"] >= 2 * HALF - 4, result
        assert result["wrong_device_copies"] == [], result
        devices = set(result["copy_devices"])
        assert {d.upper()[-5:] for d in devices} == {"CPU:0", "CPU:1"}, devices


def test_gradient_ops_follow_their_forward_op_with_colocation(measured):
    result = measured["True"]
    assert result["grad_op_devices"] == {"CPU:0": HALF, "CPU:1": HALF}, result


def test_gradients_equal_tf_gradients(measured):
    for colocate in ("False", "True"):
        assert measured[colocate]["max_abs_diff"] < 1e-6, measured[colocate]


def test_each_device_peak_drops(measured):
    mib = 2.0 ** 20
    for colocate in ("False", "True"):
        result = measured[colocate]
        base, ours = result["baseline_peaks"], result["peaks"]
        assert set(base) == set(ours) and len(base) == 2, result
        for device in base:
            # The plain backward pass keeps the 16 activations of each half.
            assert base[device] >= (HALF - 1) * mib, (device, result)
            # Kept here: 4 checkpoints + 3 recomputed + 1 gradient, ~8 MiB.
            assert ours[device] <= 0.6 * base[device], (device, result)


# ----------------------------------------------------------------- child process


def _device_suffix(device: str) -> str:
    return device.upper()[-5:]


def _build(tf):
    x = tf.compat.v1.placeholder(tf.float32, [SIZE], name="x")
    units = []
    a = x
    for device in ("/cpu:0", "/cpu:1"):
        with tf.device(device):
            for _ in range(HALF):
                a = tf.tanh(a)
                units.append(a)
    with tf.device("/cpu:1"):
        loss = tf.reduce_sum(a)
    return x, loss, units


def _measure(colocate: bool) -> dict:
    import numpy as np
    import tensorflow as tf

    import memory_saving_gradients as msg
    from memory_saving_gradients import profiling

    feed_value = np.linspace(-1.0, 1.0, SIZE).astype(np.float32)
    results = {}
    for mode in ("baseline", "ours"):
        graph = tf.Graph()
        with graph.as_default():
            x, loss, units = _build(tf)
            before = {op.name for op in graph.get_operations()}
            originals = {op.name: op for op in graph.get_operations()}
            if mode == "baseline":
                grads = tf.compat.v1.gradients(loss, x, colocate_gradients_with_ops=colocate)
            else:
                grads = msg.gradients(
                    loss, x, checkpoints=units[EVERY - 1::EVERY],
                    colocate_gradients_with_ops=colocate,
                )
                new_ops = [op for op in graph.get_operations() if op.name not in before]
                copies = [op for op in new_ops if op.type == "Tanh"]
                wrong = []
                for op in copies:
                    original = originals[op.name.rsplit("/", 1)[-1]]
                    if op.device != original.device or not op.device:
                        wrong.append((op.name, op.device, original.device))
                grad_devices: dict = {}
                for op in new_ops:
                    if op.type == "TanhGrad" and op.device:
                        key = _device_suffix(op.device)
                        grad_devices[key] = grad_devices.get(key, 0) + 1
                results["copies"] = len(copies)
                results["wrong_device_copies"] = wrong
                results["copy_devices"] = sorted({op.device for op in copies})
                results["grad_op_devices"] = grad_devices
            with tf.compat.v1.Session(graph=graph) as sess:
                values, metadata = profiling.traced_run(sess, grads, {x: feed_value})
            peaks = {
                _device_suffix(d): p
                for d, p in profiling.peak_memory_by_device(metadata).items()
            }
            results["peaks" if mode == "ours" else "baseline_peaks"] = peaks
            results[mode] = values[0]
    results["max_abs_diff"] = float(np.max(np.abs(results.pop("ours") - results.pop("baseline"))))
    return results


def _main() -> None:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    out = {str(colocate): _measure(colocate) for colocate in (False, True)}
    print(json.dumps(out))


if __name__ == "__main__":
    _main()

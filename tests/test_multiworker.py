"""tf.distribute.MultiWorkerMirroredStrategy with two worker processes on localhost.

The test starts two workers (tests/multiworker_worker.py) with a TF_CONFIG
naming only 127.0.0.1 addresses on free ports, bounds them in time and kills
them on failure.  Each worker trains the same small MLP twice, once with
``memory_saving_gradients.gradients`` and once with ``tf.compat.v1.gradients``,
called per replica inside ``strategy.run``, gradients all-reduced (RING
collectives over gRPC) across the workers.

TensorFlow's gRPC server listens on all interfaces (``0.0.0.0:port``; there
is no option for the bind address), so where unprivileged network namespaces
are available (``unshare -rn``) both workers run in a private namespace whose
only interface is the loopback.  Elsewhere they run directly, still talking
only to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

STEPS = 3
WORKER_TIMEOUT_S = 75
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiworker_worker.py")


def _private_netns_prefix() -> list:
    unshare = shutil.which("unshare")
    if not unshare:
        return []
    try:
        probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [unshare, "-rn"] if probe.returncode == 0 else []


@pytest.fixture(scope="module")
def run() -> dict:
    prefix = _private_netns_prefix()
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["MULTIWORKER_PRIVATE_NETNS"] = "1" if prefix else "0"
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(
        prefix + [sys.executable, SCRIPT, "launch", str(STEPS), str(WORKER_TIMEOUT_S)],
        capture_output=True, text=True, timeout=WORKER_TIMEOUT_S + 30, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["private_netns"] = bool(prefix)
    return result


def test_two_workers_in_sync(run):
    workers = run["workers"]
    assert [w["index"] for w in workers] == [0, 1]
    assert all(w["replicas"] == 2 for w in workers)
    # Each worker trained on its own half of the data: equal weights afterwards
    # mean the gradients were all-reduced.
    assert workers[0]["weights_checksum"] == pytest.approx(workers[1]["weights_checksum"], rel=1e-6)
    assert workers[0]["losses"] == workers[1]["losses"]


def test_losses_equal_tf_gradients(run):
    for w in run["workers"]:
        assert w["recomputed_tanh_ops"] > 0  # the rewrite did recompute
        assert len(w["losses"]) == STEPS
        assert w["losses"][-1] < w["losses"][0]
        for a, b in zip(w["losses"], w["baseline_losses"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), w
        assert w["max_weight_diff"] < 1e-5, w


def test_workers_isolated_when_namespaces_are_available(run):
    if run["private_netns"]:
        assert run["interfaces"] == ["lo"], run["interfaces"]
    assert all(1024 <= p < 65536 for p in run["ports"])

"""keras.applications models under every strategy, with grappler's fusions.

oneDNN's graph passes (and cuDNN's on GPUs) fuse ops after the rewrite; a
fusion of two ops that an ordering wait separates would close a cycle ("N
nodes in a cycle": ResNet50 with 'speed' failed so before,
docs/how-it-works.md step 4 gives the rule that prevents it).  Each model
runs in a subprocess (tests/applications_worker.py), since TensorFlow reads
TF_ENABLE_ONEDNN_OPTS once, at import: random weights, 64 px, batch 4, one
``tf.function`` per strategy ('memory', 'balanced', 'speed', a
``memory_budget`` half-way between the plan's least peak and plain, and
every 10th layer's output as a list).  Every variant must run, give a
gradient for every variable ``tf.gradients`` gives one for, and, variable by
variable, differ from ``tf.gradients``' by at most twice what moving the input
by 1e-6 of itself changes in ``tf.gradients``' own result (the model's
round-off sensitivity; batch norm over 2x2 maps with a batch of 4 makes it
large) or 1e-5 of the largest gradient, whichever is larger.

CI runs ResNet50 and DenseNet121 with oneDNN on: ResNet50 with all five,
DenseNet121 with all but the list.  The whole matrix (also the budget and the list, MobileNetV2,
EfficientNetB0, ConvNeXtTiny, and each with oneDNN off) runs with
``MSG_APPLICATIONS_MATRIX=1``; ConvNeXtTiny needs 32 px or more (64 is used).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.keras, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "applications_worker.py"
BATCH, SIZE = 4, 64
CI_MODELS = ("ResNet50", "DenseNet121")
MATRIX_MODELS = CI_MODELS + ("MobileNetV2", "EfficientNetB0", "ConvNeXtTiny")
FULL_MATRIX = os.environ.get("MSG_APPLICATIONS_MATRIX") == "1"
STRATEGIES = ("memory", "balanced", "speed", "budget", "list")
#: CI runs every strategy on ResNet50 and every automatic one on DenseNet121: a list
#: of every 10th layer's outputs is the same code on either, and on DenseNet121 (whose
#: concatenations make it recompute 26k ops) it took 34 of the worker's 130 s.
CI_STRATEGIES = {"ResNet50": STRATEGIES,
                 "DenseNet121": tuple(s for s in STRATEGIES if s != "list")}

pytest.importorskip("keras")


def run_model(name: str, onednn: str, variants=STRATEGIES) -> dict:
    """The worker's JSON result for ``name`` with TF_ENABLE_ONEDNN_OPTS=``onednn``."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2",
               KERAS_BACKEND="tensorflow",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(WORKER), name, str(BATCH), str(SIZE),
                           ",".join(variants)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(result: dict) -> None:
    variants = result["variants"]
    errors = {v: r["error"] for v, r in variants.items() if "error" in r}
    assert not errors, f"{result['model']}: {errors}"
    largest, moved = result["largest"], result["moved"]
    scale = max(largest)
    # per variable: twice what the moved input changes, or 1e-5 of the largest gradient
    tolerance = [max(2 * m, 1e-5 * scale) for m in moved]
    for strategy, got in variants.items():
        assert not got["none_pattern_differs"], f"{result['model']} {strategy}: None pattern"
        # the rewrite itself was right: no call fell back to tf.gradients
        assert "FallbackWarning" not in got["notices"], f"{result['model']} {strategy}: fell back"
        # and it rewrote: the step recomputes something, or (outside the CI models, where
        # 'memory' may find nothing worth recomputing) a NothingKeptWarning says why not
        recomputes = got["recomputed_ops"] > 0
        if result["model"] in CI_MODELS:
            assert recomputes, f"{result['model']} {strategy}: nothing recomputed"
        else:
            assert recomputes or "NothingKeptWarning" in got["notices"], (
                f"{result['model']} {strategy}: nothing recomputed and no warning")
        worst = max(range(len(tolerance)), key=lambda i: got["differences"][i] / tolerance[i])
        assert got["differences"][worst] <= tolerance[worst], (
            f"{result['model']} {strategy}: variable {worst} differs by "
            f"{got['differences'][worst]:.3g}, tolerance {tolerance[worst]:.3g} (moving the "
            f"input by 1e-6 changes it by {moved[worst]:.3g}; its largest gradient "
            f"{largest[worst]:.3g})")


def _cases():
    if FULL_MATRIX:
        return [(name, onednn, STRATEGIES) for onednn in ("1", "0") for name in MATRIX_MODELS]
    return [(name, "1", CI_STRATEGIES[name]) for name in CI_MODELS]


@pytest.mark.parametrize("name,onednn,variants", _cases())
def test_application_gradients_equal_tf_gradients_under_every_strategy(name, onednn, variants):
    result = run_model(name, onednn, variants)
    assert sorted(result["variants"]) == sorted(variants)
    if onednn == "1":
        assert result["onednn"], "TF_ENABLE_ONEDNN_OPTS=1 but TensorFlow reports oneDNN off"
    print(json.dumps(result))
    check(result)

"""``tf.autodiff.ForwardAccumulator`` under the patch: Jacobian-vector products stay right.

An accumulator computes each op's JVP with a helper that TensorFlow traces once and
caches for the whole process: two tapes inside it are linked by ``record_gradient``,
not by ops.  Were the patched ``gradient()`` to build those tapes' gradients, the JVPs
would come out None or wrong, in the block and after it (the cached helper stays).
Each case runs in a fresh process, where no helper has been traced yet.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.subprocess]

ROOT = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys, warnings
import numpy as np
import tensorflow as tf
import memory_saving_gradients as msg

strategy = sys.argv[1]
x = tf.constant([[0.3, -1.2], [2.0, 0.5]])
expected = 1.0 - np.tanh(x.numpy()) ** 2

def jvp(x):
    with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)) as acc:
        y = tf.tanh(x)
    return acc.jvp(y)

def error(value):
    return None if value is None else float(np.abs(value.numpy() - expected).max())

rng = np.random.RandomState(0)
weights = [tf.Variable(rng.randn(16, 16).astype("float32") * 0.3) for _ in range(3)]
tangents = [tf.constant(rng.randn(16, 16).astype("float32")) for _ in range(3)]
inputs = tf.constant(rng.randn(8, 16).astype("float32"))

def loss_of(ws):
    h = inputs
    for w in ws:
        h = tf.tanh(h @ w)
    return tf.reduce_sum(h ** 2)

@tf.function
def forward_over_back():
    with tf.autodiff.ForwardAccumulator(weights, tangents) as acc:
        with tf.GradientTape() as tape:
            loss = loss_of(weights)
        grads = tape.gradient(loss, weights)
    return acc.jvp(grads)

def back_over_back():  # the reference Hessian-vector product, eagerly
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            loss = loss_of(weights)
        grads = inner.gradient(loss, weights)
        dot = tf.add_n([tf.reduce_sum(g * t) for g, t in zip(grads, tangents)])
    return outer.gradient(dot, weights)

out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with msg.patched(strategy):
        out["eager"] = error(jvp(x))
        out["function"] = error(tf.function(jvp)(x))
        hvp = forward_over_back()
out["after"] = error(jvp(x))
reference = back_over_back()
out["hvp"] = [None if h is None else float(np.abs(h.numpy() - r.numpy()).max()
                                           / np.abs(r.numpy()).max())
              for h, r in zip(hvp, reference)]
out["warnings"] = [str(w.message) for w in caught]
print(json.dumps(out))
"""


def _run(strategy: str) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT, strategy], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("strategy", ["memory", "speed"])
def test_forward_mode_products_are_right_under_and_after_the_patch(strategy):
    out = _run(strategy)
    # an op's JVP, eagerly and traced, in the block and after it (its cached helper)
    for where in ("eager", "function", "after"):
        assert out[where] is not None, (where, out)
        assert out[where] < 1e-6, (where, out)
    # forward over reverse: the accumulator differentiates the tape's gradient, which
    # stays plain tf.gradients; equal to the Hessian-vector product taken backwards twice
    assert all(e is not None and e < 1e-4 for e in out["hvp"]), out["hvp"]
    rewrote_nothing = [w for w in out["warnings"] if "rewrote nothing" in w]
    assert rewrote_nothing, out["warnings"]
    # the warning names the accumulator, not a NothingKeptWarning that never came
    assert "ForwardAccumulator" in rewrote_nothing[0], rewrote_nothing[0]
    assert "NothingKeptWarning says why" not in rewrote_nothing[0], rewrote_nothing[0]

"""A training step compiled with XLA (`jit_compile=True`), with one added line.

    python examples/xla_step.py                   # tiny: runs in seconds
    python examples/xla_step.py --scale 8         # 8x the batch

XLA would merge recomputed copies back into the forward pass; while a step is
traced for XLA, the library makes every recomputed input depend on the
incoming gradient through data, so the recomputation survives compilation
(docs/xla.md; measured on CPU XLA, GPU XLA untested).  The script runs the
same step with and without the patch and prints the losses and the
allocator's peak of one compiled step, which includes XLA's temporary buffer.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg


def make_step(weights):
    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_mean(tf.square(h))
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(0.1 * g)
        return loss
    return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="batch multiplier")
    parser.add_argument("--depth", type=int, default=24)
    args = parser.parse_args(argv)
    batch = 1024 * args.scale
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch, 256)).astype("float32"))
    init = [(rng.standard_normal((256, 256)) / 16).astype("float32") for _ in range(args.depth)]

    results = {}
    for name in ("plain", "patched"):
        weights = [tf.Variable(w) for w in init]
        step = make_step(weights)
        if name == "patched":
            with msg.patched("memory"):  # <- the one line
                step.get_concrete_function(x)  # traced for XLA (and rewritten) here
        losses = [float(step(x))]  # compiles
        peak = msg.peak_memory_during(lambda: losses.append(float(step(x))))
        losses.append(float(step(x)))
        results[name] = (peak, losses)
        print(f"{name:>8}: peak {peak / 2**20:7.1f} MiB per compiled step, losses "
              + ", ".join(f"{v:.5f}" for v in losses))
    plain, ours = results["plain"][0], results["patched"][0]
    print(f"saved {(plain - ours) / 2**20:.1f} MiB ({ours / max(plain, 1):.2f}x of plain)")
    return {"plain_peak": plain, "peak": ours,
            "plain_losses": results["plain"][1], "losses": results["patched"][1]}


if __name__ == "__main__":
    main()

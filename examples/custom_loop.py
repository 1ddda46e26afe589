"""A custom training loop in a `tf.function`, batch dimension unknown, one added line.

    python examples/custom_loop.py                # tiny: runs in seconds
    python examples/custom_loop.py --scale 8      # 8x the batch

The step uses a plain `tf.GradientTape` and an `input_signature` with a batch
of `None`, as TF2 code does.  `memory_saving_gradients.patch()` before the step
is traced makes its tape checkpoint; `batch_size=` tells the planner the
batch you feed (without it, unknown dimensions count as 32).  The script runs
the same steps with and without it and prints the losses and the allocator's
peak of one step.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg


def make_step(weights, optimizer):
    @tf.function(input_signature=[tf.TensorSpec([None, 256], tf.float32),
                                  tf.TensorSpec([None], tf.int32)])
    def step(x, labels):
        with tf.GradientTape() as tape:
            h = x
            for w in weights[:-1]:
                h = tf.nn.gelu(tf.matmul(h, w))
            logits = tf.matmul(h, weights[-1])
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        grads = tape.gradient(loss, weights)
        optimizer.apply_gradients(zip(grads, weights))
        return loss
    return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="batch multiplier")
    parser.add_argument("--depth", type=int, default=16)
    args = parser.parse_args(argv)
    batch = 512 * args.scale
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((batch, 256)).astype("float32"))
    labels = tf.constant(rng.integers(0, 10, batch).astype("int32"))
    init = [(rng.standard_normal((256, 256)) * np.sqrt(2 / 256)).astype("float32")
            for _ in range(args.depth)]
    init.append((rng.standard_normal((256, 10)) / 16).astype("float32"))

    results = {}
    for name in ("plain", "patched"):
        weights = [tf.Variable(w) for w in init]
        step = make_step(weights, tf.keras.optimizers.SGD(0.01))
        if name == "patched":
            with msg.patched("memory", batch_size=batch):  # <- the one line
                step.get_concrete_function()  # traced (and rewritten) here
        losses = [float(step(x, labels))]  # first step: optimizer slots, warm-up
        peak = msg.peak_memory_during(lambda: losses.append(float(step(x, labels))))
        losses += [float(step(x, labels)) for _ in range(2)]
        results[name] = (peak, losses)
        print(f"{name:>8}: peak {peak / 2**20:7.1f} MiB per step, losses "
              + ", ".join(f"{v:.4f}" for v in losses))
    plain, ours = results["plain"][0], results["patched"][0]
    print(f"saved {(plain - ours) / 2**20:.1f} MiB ({ours / max(plain, 1):.2f}x of plain)")
    return {"plain_peak": plain, "peak": ours,
            "plain_losses": results["plain"][1], "losses": results["patched"][1]}


if __name__ == "__main__":
    main()

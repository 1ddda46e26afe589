"""The classic use: `tf.compat.v1` graph, `gradients()` and the `tf.gradients` monkeypatch.

    python examples/v1_graph.py                   # tiny: runs in seconds
    python examples/v1_graph.py --scale 4         # 4x the batch

Builds a ReLU MLP in a v1 graph with a placeholder of batch `None`, takes its
gradients three ways (TensorFlow's, `memory_saving_gradients.gradients` with
`checkpoints='memory'`, and `tf.gradients` replaced as the original tool
did), runs each in a session with full tracing and prints the measured peaks
(`memory_saving_gradients.peak_memory`) and the largest difference from
TensorFlow's gradients.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients import profiling


def build(depth: int):
    """An MLP in the default graph; returns (loss, weights, input placeholder)."""
    rng = np.random.default_rng(0)
    x = tf.compat.v1.placeholder(tf.float32, [None, 256], name="x")
    h, weights = x, []
    for i in range(depth):
        w = tf.Variable((rng.standard_normal((256, 256)) * np.sqrt(2 / 256)).astype(np.float32),
                        name=f"w{i}")
        weights.append(w)
        h = tf.nn.relu(tf.matmul(h, w))
    return tf.reduce_mean(tf.square(h)), weights, x


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="batch multiplier")
    parser.add_argument("--depth", type=int, default=24)
    args = parser.parse_args(argv)
    batch = 512 * args.scale
    data = np.random.default_rng(1).standard_normal((batch, 256)).astype(np.float32)

    peaks, values = {}, {}
    for name in ("tf.gradients", "gradients(checkpoints='memory')", "patched tf.gradients"):
        with tf.Graph().as_default():
            loss, weights, x = build(args.depth)
            if name == "tf.gradients":
                grads = tf.gradients(loss, weights)
            elif name.startswith("gradients("):
                grads = msg.gradients(loss, weights, checkpoints="memory", batch_size=batch)
            else:
                # The original tool's one line (undone at the end of the block):
                with msg.patched("memory", batch_size=batch):
                    grads = tf.gradients(loss, weights)
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                got, metadata = profiling.traced_run(session, grads, {x: data})
        peaks[name] = sum(msg.peak_memory(metadata).values())
        values[name] = got
        print(f"{name:>34}: peak {peaks[name] / 2**20:7.1f} MiB")
    worst = max(
        float(np.max(np.abs(a - b))) for name in list(values)[1:]
        for a, b in zip(values[name], values["tf.gradients"])
    )
    print(f"largest difference from tf.gradients: {worst:.2e}")
    return {"peaks": peaks, "max_difference": worst}


if __name__ == "__main__":
    main()

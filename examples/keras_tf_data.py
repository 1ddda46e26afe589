"""Keras 3 `fit` on a tf.data pipeline, with one added line.

    python examples/keras_tf_data.py              # tiny: runs in seconds
    python examples/keras_tf_data.py --scale 8    # 8x the batch

The pipeline is batched without drop_remainder, so the batch dimension is
unknown (None) in the traced step, as in most real training code.  The model
trains twice from the same weights, without and with the library, and the
script prints each run's losses and the peak bytes the allocator held during
`fit` (`memory_saving_gradients.peak_memory_during`).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg


def build(width: int, depth: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    stack = [keras.Input((width,))]
    for _ in range(depth):
        stack += [keras.layers.Dense(width), keras.layers.BatchNormalization(),
                  keras.layers.Activation("gelu")]
    model = keras.Sequential(stack + [keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="batch multiplier")
    parser.add_argument("--depth", type=int, default=12)
    args = parser.parse_args(argv)
    # Activations of 256 KiB and up: the CPU allocator's statistics count no smaller ones.
    width, batch = 256, 256 * args.scale
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * 3 + batch // 2, width)).astype("float32")
    y = rng.integers(0, 10, len(x))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)  # last batch partial

    results = {}
    for name in ("plain", "memory_saving_gradients"):
        model = build(width, args.depth)
        if name == "plain":
            model.fit(data.take(1), verbose=0)  # trace and warm up (optimizer slots)
        else:
            with msg.patched("memory"):  # <- the one line: every tape checkpoints
                model.fit(data.take(1), verbose=0)  # traced (and rewritten) here
        peak = msg.peak_memory_during(lambda: model.fit(data, epochs=2, verbose=0))
        results[name] = (peak, model.history.history["loss"])
        print(f"{name:>24}: peak {peak / 2**20:7.1f} MiB during fit, losses "
              + ", ".join(f"{v:.4f}" for v in results[name][1]))
    plain, ours = results["plain"][0], results["memory_saving_gradients"][0]
    print(f"saved {(plain - ours) / 2**20:.1f} MiB ({ours / max(plain, 1):.2f}x of plain)")
    return {"plain_peak": plain, "peak": ours,
            "plain_losses": results["plain"][1], "losses": results["memory_saving_gradients"][1]}


if __name__ == "__main__":
    main()

"""tf_keras (Keras 2) `fit` with `memory_saving_gradients.keras.enable`.

    python examples/tf_keras_fit.py               # tiny: runs in seconds
    python examples/tf_keras_fit.py --scale 8     # 8x the batch

tf_keras' `train_step` computes gradients with `optimizer.minimize(loss,
variables, tape=tape)`; `enable(model)` makes the tape in it checkpoint.  The
script trains the same small convnet twice from the same weights, without and
with it, and prints the losses and the allocator's peak during `fit`.
Needs `pip install tf-keras`.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
import tf_keras

import memory_saving_gradients as msg


def build(blocks: int) -> "tf_keras.Model":
    tf_keras.utils.set_random_seed(0)
    layers = [tf_keras.layers.Conv2D(32, 3, padding="same", input_shape=(32, 32, 3))]
    for _ in range(blocks):
        layers += [tf_keras.layers.BatchNormalization(), tf_keras.layers.ReLU(),
                   tf_keras.layers.Conv2D(32, 3, padding="same")]
    layers += [tf_keras.layers.GlobalAveragePooling2D(), tf_keras.layers.Dense(10)]
    model = tf_keras.Sequential(layers)
    model.compile(optimizer=tf_keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="batch multiplier")
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args(argv)
    batch = 16 * args.scale
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * 3, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, len(x))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    results = {}
    for name in ("plain", "enable"):
        model = build(args.blocks)
        if name == "enable":
            msg.keras.enable(model, batch_size=batch)  # <- the one line
        model.fit(data.take(1), verbose=0)  # trace and warm up
        peak = msg.peak_memory_during(lambda: model.fit(data, epochs=2, verbose=0))
        results[name] = (peak, model.history.history["loss"])
        print(f"{name:>7}: peak {peak / 2**20:7.1f} MiB during fit, losses "
              + ", ".join(f"{v:.4f}" for v in results[name][1]))
    plain, ours = results["plain"][0], results["enable"][0]
    print(f"saved {(plain - ours) / 2**20:.1f} MiB ({ours / max(plain, 1):.2f}x of plain)")
    return {"plain_peak": plain, "peak": ours,
            "plain_losses": results["plain"][1], "losses": results["enable"][1]}


if __name__ == "__main__":
    main()

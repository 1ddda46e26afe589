"""The largest batch a Keras model trains in a given memory, plain and checkpointed.

    python examples/largest_batch.py              # tiny: runs in seconds (64 MB)
    python examples/largest_batch.py --scale 4    # 4x the memory (and the batch)

`memory_saving_gradients.keras.largest_batch(model, memory=...)` traces one
training step on the model's input spec (batch None), counts the model's
variables and the optimizer's slots, and returns the largest batch whose
predicted step fits the memory, before anything runs.  On a GPU, `memory`
defaults to the device's free memory.  The script asks for plain
`tf.gradients` (`checkpoints=None`) and for `'memory'`, then trains one step
at each batch and prints what the allocator held (variables and slots, plus
the step's own peak, `memory_saving_gradients.peak_memory_during`).
"""

from __future__ import annotations

import argparse
import contextlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import memory_saving_gradients as msg

WIDTH, DEPTH = 256, 12


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    stack = [keras.Input((WIDTH,))]
    for _ in range(DEPTH):
        stack += [keras.layers.Dense(WIDTH), keras.layers.BatchNormalization(),
                  keras.layers.Activation("relu")]
    model = keras.Sequential(stack + [keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train_one_step(model, batch: int, checkpointed: bool) -> tuple:
    """(loss, bytes held: variables and slots plus the step's own peak) of one step at
    ``batch``, after a first step that traces it."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, WIDTH)).astype("float32")
    y = rng.integers(0, 10, batch)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    with msg.patched("memory") if checkpointed else contextlib.nullcontext():
        model.fit(data, verbose=0)  # traced (and, checkpointed, rewritten) here
    history = []
    peak = msg.peak_memory_during(lambda: history.append(model.fit(data, verbose=0)))
    return history[-1].history["loss"][-1], peak + msg.keras.model_bytes(model)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="memory multiplier")
    args = parser.parse_args(argv)
    memory = 64 * 2**20 * args.scale
    rows = {}
    for name, checkpoints in (("tf.gradients", None), ("checkpoints='memory'", "memory")):
        model = build()
        batch = msg.keras.largest_batch(model, memory=memory, checkpoints=checkpoints)
        loss, held = train_one_step(model, batch, checkpointed=checkpoints is not None)
        rows[name] = {"batch": batch, "held": held, "loss": loss}
        print(f"{name:>22}: largest batch in {memory / 2**20:.0f} MB: {batch:6d}; one step "
              f"there held {held / 2**20:6.1f} MB (loss {loss:.3f})")
    ratio = rows["checkpoints='memory'"]["batch"] / max(rows["tf.gradients"]["batch"], 1)
    print(f"checkpointing trains a {ratio:.1f}x larger batch in the same memory")
    return {"memory": memory, "rows": rows}


if __name__ == "__main__":
    main()

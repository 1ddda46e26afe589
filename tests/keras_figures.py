"""Figures of docs/keras.md's "What CI checks" and "Where it saves nothing" tables.

Runs the Keras tests' own helpers (tests/test_keras_models.py, tests/test_tf_keras.py)
and prints the allocator peaks they compare, plus the tf_keras v1-graph nets with
batch norm / dropout / neither::

    PYTHONPATH=$PWD python tests/keras_figures.py
"""

from __future__ import annotations

import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import tensorflow as tf  # noqa: E402

import memory_saving_gradients as msg  # noqa: E402
from bench import keras_suite as suite  # noqa: E402
from memory_saving_gradients import profiling  # noqa: E402

MIB = 1 << 20


def _v1_net(tf_keras, batch_norm: bool, dropout: bool, patched: bool) -> int:
    """Peak bytes of the last traced step of a tf_keras v1-graph fit (legacy SGD)."""
    with tf.Graph().as_default():
        tf_keras.utils.set_random_seed(0)
        layers = tf_keras.layers
        stack = [tf_keras.Input((32, 32, 3))]
        for _ in range(8):
            stack.append(layers.Conv2D(8, 3, padding="same"))
            stack += [layers.BatchNormalization()] if batch_norm else []
            stack.append(layers.ReLU())
            stack += [layers.Dropout(0.2)] if dropout else []
        model = tf_keras.Sequential(stack + [layers.GlobalAveragePooling2D(), layers.Dense(10)])
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        metadata = tf.compat.v1.RunMetadata()
        model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.01, momentum=0.9),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      options=options, run_metadata=metadata)
        x, y = suite.conv_data(dict(batch=32, image=32, classes=10), 3)
        with msg.patched() if patched else contextlib.nullcontext():
            model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        return sum(profiling.peak_memory(metadata).values())


def main() -> None:
    import test_keras_models as hub_tests
    import test_tf_keras as tfk_tests

    variants = ("plain", "enable", "patched")
    for case in ("gpt2_fit", "bert_fit"):
        peaks = {v: suite.run_case(case, v, hub_tests.HUB_SIZE)["alloc_peak_mb"] for v in variants}
        print(f"{case} (test size): allocator peak MiB {peaks}")
    peaks = {v: suite.run_case("tf_keras_fit", v, tfk_tests.CONV_SIZE)["alloc_peak_mb"]
             for v in variants}
    print(f"tf_keras functional: allocator peak MiB {peaks}")
    peaks = {v: tfk_tests._fit_sequential(v)["alloc_peak_mb"] for v in variants}
    print(f"tf_keras Sequential + dropout: allocator peak MiB {peaks}")
    plain, ours = (tfk_tests._fit_v1_graph(p)[1] / MIB for p in (False, True))
    print(f"tf_keras v1 graph, legacy SGD, conv-ReLU: last step peak MiB {plain:.1f} -> {ours:.1f}")

    _, _, _, tape_peak, our_peak = hub_tests.mobilenet_step()
    print(f"MobileNetV2 64 px batch 32: allocator peak MiB tape {tape_peak / MIB:.1f}, "
          f"gradients() {our_peak / MIB:.1f}")

    tf_keras = suite.import_tf_keras()
    for name, bn, drop in (("conv-BN-ReLU", True, False), ("conv-ReLU-dropout", False, True),
                           ("conv-ReLU", False, False)):
        plain, ours = (_v1_net(tf_keras, bn, drop, p) / 1e6 for p in (False, True))
        print(f"tf_keras v1 graph, 8 x {name}: last step peak MB {plain:.1f} -> {ours:.1f}")


if __name__ == "__main__":
    main()

"""Train a deep Keras 3 MLP with and without memory-saving gradients.

    python examples/keras_fit.py                       # small, with enable()
    python examples/keras_fit.py --plain               # the same without it
    python examples/keras_fit.py --layers 48 --width 1024 --batch 4096 --steps 2

Prints the loss of each step (before its update), the loss after training,
and the process's peak resident memory
(Linux's ``VmHWM``); run it twice (with and without ``--plain``) to compare,
each in its own process, since peak RSS never goes down.  ``--json`` prints
one JSON line instead (the tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import memory_saving_gradients
import memory_saving_gradients.keras


def build_model(layers: int, width: int, inputs: int, dropout: float = 0.0) -> keras.Model:
    """``layers`` x (Dense(width) + ReLU [+ Dropout]), then Dense(1)."""
    stack = [keras.Input((inputs,))]
    for _ in range(layers):
        stack.append(keras.layers.Dense(width, activation="relu", kernel_initializer="he_normal"))
        if dropout:
            stack.append(keras.layers.Dropout(dropout))
    stack.append(keras.layers.Dense(1))
    return keras.Sequential(stack)  # built once (Sequential.add rebuilds every time)


def peak_rss_kib() -> int:
    """This process's peak resident set (KiB): Linux's ``VmHWM``, which starts afresh
    with the program; ``ru_maxrss`` elsewhere, which on Linux keeps the parent's peak
    when that was higher (a test suite's process, grown past this program's peak)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--checkpoints", default="memory",
                        help="strategy name, as for memory_saving_gradients.gradients")
    parser.add_argument("--plain", action="store_true", help="train without enable()")
    parser.add_argument("--no-eval", action="store_true",
                        help="skip the evaluation after training (saves a forward pass)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.width)).astype("float32")
    y = (x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")

    model = build_model(args.layers, args.width, args.width, args.dropout)
    model.compile(optimizer=keras.optimizers.SGD(args.lr), loss="mse")
    if not args.plain:
        memory_saving_gradients.keras.enable(model, checkpoints=args.checkpoints)

    start = time.perf_counter()
    # One batch per epoch: each epoch's loss is the loss of one step.
    history = model.fit(x, y, batch_size=args.batch, epochs=args.steps, shuffle=False, verbose=0)
    seconds = time.perf_counter() - start
    final_loss = None
    if not args.no_eval:
        final_loss = float(model.evaluate(x, y, batch_size=args.batch, verbose=0))
    peak_kib = peak_rss_kib()
    result = dict(
        enabled=not args.plain,
        checkpoints=None if args.plain else args.checkpoints,
        losses=[float(v) for v in history.history["loss"]],
        final_loss=final_loss,
        peak_rss_mib=peak_kib / 1024,
        fit_seconds=seconds,
        cpu_seconds=sum(resource.getrusage(resource.RUSAGE_SELF)[:2]),
    )
    if args.json:
        print(json.dumps(result))
    else:
        mode = f"enable(checkpoints={args.checkpoints!r})" if not args.plain else "plain Keras"
        print(f"{mode}: {args.layers} x Dense({args.width}), batch {args.batch}")
        for step, loss in enumerate(result["losses"], 1):
            print(f"  step {step}: loss {loss:.4f}")
        if final_loss is not None:
            print(f"  after training: loss {final_loss:.4f}")
        print(f"  peak RSS {result['peak_rss_mib']:.0f} MiB, fit took {seconds:.1f} s")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

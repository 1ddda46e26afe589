"""GPU check: CIFAR ResNet v2 (batch 128, depth 122 = 6*20+2) with tf.gradients vs 'memory'.

When TensorFlow sees a GPU, both variants are built on ``/GPU:0`` and
measured like the benchmark does (peak from the GPU allocator's records of a
traced step, e.g. ``GPU_0_bfc``; median step time with the two variants'
steps interleaved).  Prints both peaks, the peak ratio and the time ratio,
and exits 1 if 'memory' peaks above ``--max-ratio`` (0.25) of tf.gradients
or a variant fails.  Without a GPU it prints that it skipped and why, and
exits 0.

Then, where a GPU is present (or with ``--xla``), the same step compiled with
``tf.function(jit_compile=True)``: XLA's temp bytes (its buffer assignment,
from the ``--xla_dump_to`` memory report) and step time of tf.gradients vs
'memory', and their gradients against tf.gradients under XLA (exit 1 if they
differ).  ``--max-xla-ratio`` makes the XLA temp ratio a pass/fail limit too.

    python benchmarks/gpu_resnet.py [--depth 122] [--batch 128] [--steps 5] [--no-xla]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # test_models/ lives in the source checkout
    sys.path.insert(0, _ROOT)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=122, help="ResNet depth, 6n+2")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--max-ratio", type=float, default=0.25,
                   help="fail if memory's peak / tf.gradients' peak is above this")
    p.add_argument("--cpu", action="store_true",
                   help="run the same comparison on the CPU (to check this script without a GPU)")
    p.add_argument("--xla", action="store_true",
                   help="also compare under jit_compile on the CPU (on a GPU it always runs)")
    p.add_argument("--no-xla", action="store_true", help="skip the jit_compile comparison")
    p.add_argument("--max-xla-ratio", type=float, default=None,
                   help="fail if memory's XLA temp / tf.gradients' XLA temp is above this")
    args = p.parse_args(argv)

    from bench import xla as xla_lib
    from memory_saving_gradients._units import MIB

    dump = None if args.no_xla else xla_lib.XlaDump()  # before anything compiles with XLA
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus and not args.cpu:
        built_with_cuda = tf.test.is_built_with_cuda()
        why = ("this TensorFlow build has no CUDA support (e.g. tensorflow-cpu)"
               if not built_with_cuda else "no GPU is visible (driver, CUDA_VISIBLE_DEVICES?)")
        print(f"gpu_resnet: SKIPPED: TensorFlow {tf.__version__} sees no GPU: {why}.")
        return 0

    from bench import core, models

    device = "/CPU:0" if args.cpu else "/GPU:0"
    spec = models.resnet_spec(args.depth, args.batch)
    print(f"gpu_resnet: ResNet v2 depth {args.depth}, batch {args.batch}, on {device} "
          f"(TensorFlow {tf.__version__})", flush=True)
    prepared = [core.prepare(spec, v, device=device) for v in ("tf.gradients", "memory")]
    try:
        core.time_interleaved(prepared, args.steps)
    finally:
        for item in prepared:
            item.close()
    base, mem = (item.result for item in prepared)
    for r in (base, mem):
        if not r.ok:
            print(f"gpu_resnet: FAILED: {r.variant}: {r.error}")
            return 1
        print(f"  {r.variant:<13s} peak {r.peak_bytes / MIB:9.1f} MB ({r.allocators})  "
              f"step {r.median_step_seconds:.4f} s  rewrite {r.rewrite_seconds:.1f} s  "
              f"grads equal: {'yes' if r.grads_equal else 'NO'}")
    ratio = mem.peak_bytes / base.peak_bytes
    time_ratio = mem.median_step_seconds / base.median_step_seconds
    print(f"  memory / tf.gradients: peak {ratio:.3f}x (limit {args.max_ratio}x), "
          f"step time {time_ratio:.2f}x")
    if not mem.grads_equal:
        print("gpu_resnet: FAILED: 'memory' gradients differ from tf.gradients")
        return 1
    if ratio > args.max_ratio:
        print(f"gpu_resnet: FAILED: peak ratio {ratio:.3f} > {args.max_ratio}")
        return 1
    if dump is not None and (gpus or args.xla):
        status = _xla(spec, args, dump, device, xla_lib)
        if status:
            return status
    print("gpu_resnet: OK")
    return 0


def _xla(spec, args, dump, device, xla_lib) -> int:
    """The same step under tf.function(jit_compile=True): XLA temp and time, plain vs 'memory'."""
    import tensorflow as tf

    from memory_saving_gradients._units import MIB

    print(f"  under jit_compile=True on {device}:", flush=True)
    with tf.device(device):
        rows = xla_lib.measure_xla(spec, ("tf.gradients", "memory"), dump=dump, steps=args.steps)
    plain, mem = rows
    for r in rows:
        print(f"  xla {r.variant:<13s} temp {r.temp_bytes / MIB:9.1f} MB  "
              f"step {r.step_seconds:.4f} s  grads vs tf.gradients under XLA: "
              f"{r.max_rel_error_vs_xla:.1e}")
    ratio = mem.temp_bytes / max(plain.temp_bytes, 1)
    print(f"  xla memory / tf.gradients: temp {ratio:.3f}x, step time "
          f"{mem.step_seconds / plain.step_seconds:.2f}x")
    if mem.max_rel_error_vs_xla > 1e-3:
        print("gpu_resnet: FAILED: 'memory' gradients under XLA differ from tf.gradients'")
        return 1
    if args.max_xla_ratio is not None and ratio > args.max_xla_ratio:
        print(f"gpu_resnet: FAILED: XLA temp ratio {ratio:.3f} > {args.max_xla_ratio}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

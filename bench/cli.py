"""``python -m bench``: the sweep, the fits-in-N-MB search,
the training check, and the tables and plots, from one command.

``--repeats N`` runs the sweep N times (the frontier checks per run and in
every run); ``--fits-time-limit X`` (default 1.25, 0: off) adds the fits row
of the largest ResNet depth whose step, with a budget chosen for the cap,
takes at most X times plain tf.gradients' CPU time
(:func:`bench.fits.fits_in_time`)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import List, Optional

from memory_saving_gradients._units import MIB

from . import core
from .fits import DEFAULT_TIME_LIMIT

DEFAULT_VARIANTS = tuple(v for v in core.VARIANTS if v != "tf.function")
DEFAULT_FITS_VARIANTS = ("tf.gradients", "recompute_grad", "memory")  # + memory+budget: --fits-variants


def _csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Option defaults shown; the description and the variant list keep their lines."""


def parser() -> argparse.ArgumentParser:
    from .models import DEFAULT_MODELS

    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure peak memory and step time of memory_saving_gradients against\n"
        "tf.gradients, grappler's recomputation and tf.recompute_grad on real models.\n"
        "Every number is measured in this run (peaks from the allocator's records of a\n"
        "traced step; times are medians of untraced steps, interleaved across variants).",
        formatter_class=_HelpFormatter,
        epilog="variants:\n" + "\n".join(f"  {k:<19s} {v}" for k, v in core.VARIANT_HELP.items()),
    )
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma-separated models from test_models/")
    p.add_argument("--depths", default=None,
                   help="ResNet depths (6n+2), comma-separated; default 20,56,110,164 (quick: 8,14)")
    p.add_argument("--batch", type=int, default=None, help="batch size for every model "
                   "(default: each model's sweep size, ResNet 32)")
    p.add_argument("--size", action="append", default=[], metavar="MODEL.KEY=VALUE",
                   help="override a model size keyword, e.g. transformer.layers=24 (repeatable)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated, from: " + ", ".join(core.VARIANTS))
    p.add_argument("--budget-fraction", type=float, default=core.DEFAULT_BUDGET_FRACTION,
                   help="memory+budget: memory_budget as a fraction of plan()'s predicted "
                   "tf.gradients peak")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per variant, after one untimed round, in the sweep and the "
                   "timed fits search (default 8; quick: 2)")
    p.add_argument("--cap-mb", type=float, default=None,
                   help="'fits in N MB': the memory cap (0: skip the search; default 48, "
                   "quick: 0.6)")
    p.add_argument("--fits-over", choices=("depth", "batch"), default="depth",
                   help="search ResNet depth (at --fits-batch) or batch (at --fits-depth)")
    p.add_argument("--fits-batch", type=int, default=None, help="batch for the depth search "
                   "(default: the sweep's ResNet batch)")
    p.add_argument("--fits-depth", type=int, default=56, help="depth for the batch search")
    p.add_argument("--fits-variants", default=",".join(DEFAULT_FITS_VARIANTS),
                   help="variants searched for the cap (memory+budget: the cap as its budget)")
    p.add_argument("--fits-time-limit", type=float, default=None, metavar="X",
                   help="also search the largest ResNet depth that fits the cap with its step at "
                   "most X times tf.gradients' CPU time per step, 'memory' with a budget chosen "
                   "for the cap per depth, timed (--steps) against tf.gradients at that depth "
                   f"(default {DEFAULT_TIME_LIMIT:g}; 0: off; each probe builds two or three steps)")
    p.add_argument("--train-steps", type=int, default=None,
                   help="SGD steps of the transformer for the loss-curve check (0: skip; "
                   "default 50, quick: 5)")
    p.add_argument("--train-strategy", default="memory",
                   help="checkpoints= of the memory-saving run in the loss-curve check")
    p.add_argument("--scaling-sizes", default=None,
                   help="graph sizes (ops, comma-separated) for the rewrite-time rows of "
                   "bench.rewrite_time; 'none' to skip (default 2500, about "
                   "a minute; quick: none; issue-sized: 10000,100000, many minutes)")
    p.add_argument("--frontier", type=int, default=0, metavar="N",
                   help="also measure N 'memory' runs with memory_budget from the least "
                   "predicted peak to tf.gradients' (even in ratio), timed with the anchors; "
                   "writes pareto.png (needs the 'memory' variant; 0: off, the default, "
                   "as 8 points on the default models take longer than the 15-minute sweep)")
    p.add_argument("--repeats", type=int, default=1, metavar="N",
                   help="run the sweep N times (every model size rebuilt, traced and timed again "
                   "in each); the frontier checks get one table per run and a table of whether "
                   "each holds in every run")
    p.add_argument("--xla", action="store_true",
                   help="also compile each model's gradient step with tf.function(jit_compile="
                   "True): XLA temp memory (its buffer assignment) and step time of "
                   "tf.gradients, recompute_grad, collection and 'memory'; xla.md/.csv/.png")
    p.add_argument("--xla-only", action="store_true",
                   help="only the --xla comparison (no sweep, fits, training or scaling)")
    p.add_argument("--largest-batch", type=float, default=0, metavar="MB",
                   help="only the largest-batch comparison (no sweep): per model, with its "
                   "batch unknown, the largest batch predicted to fit MB (e.g. 256), plain and "
                   "'memory', each verified by a traced step at that batch; "
                   "largest_batch.md/.csv (a few minutes on 2 cores)")
    p.add_argument("--xla-variants", default=None,
                   help="comma-separated variants of the --xla comparison (default: "
                   "tf.gradients,recompute_grad,collection,memory)")
    p.add_argument("--out", default="bench_out", help="output folder")
    p.add_argument("--device", default="auto",
                   help="auto (GPU if TensorFlow sees one), cpu, gpu, or a device like /GPU:1")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, 2 steps, small cap, 5 training steps: a smoke test")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--suite", choices=("default", "keras"), default="default",
                   help="keras: the Keras suite instead of the sweep (Keras 3 / tf_keras fit, "
                   "a custom loop, keras-hub GPT-2 and BERT; plain vs patched() / "
                   "keras.enable / RematScope, each in its own process; uses --out, --quick)")
    return p


def resolve_device(choice: str) -> str:
    from memory_saving_gradients._tensorflow import gpu_visible

    if choice == "auto":
        return "/GPU:0" if gpu_visible() else ""
    if choice == "cpu":
        return "/CPU:0"
    if choice == "gpu":
        return "/GPU:0"
    return choice


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.suite == "keras":
        from . import keras_suite

        return keras_suite.main(out=args.out, quick=args.quick, command=" ".join(
            ["python -m bench"] + list(sys.argv[1:] if argv is None else argv)))
    dump = None
    if args.xla or args.xla_only:
        from . import xla as xla_lib

        dump = xla_lib.XlaDump()  # before anything in this process compiles with XLA
    from memory_saving_gradients._tensorflow import tf

    from . import fits as fits_lib
    from . import models, report, sweep, training

    started = time.time()
    load_before = _load()
    device = resolve_device(args.device)
    variants = _csv(args.variants)
    unknown = [v for v in variants if v not in core.VARIANTS]
    if unknown:
        print(f"unknown variant(s) {unknown}; known: {', '.join(core.VARIANTS)}", file=sys.stderr)
        return 2
    runnable = []
    for v in variants:
        why_not = core.library_available(v)
        if why_not:
            print(f"note: variant {v!r} skipped: {why_not}")
        else:
            runnable.append(v)
    _quick_defaults(args)
    steps = args.steps
    depths = [int(d) for d in _csv(args.depths)] if args.depths else None
    specs = models.specs(_csv(args.models), quick=args.quick, depths=depths, batch=args.batch,
                         overrides=models.parse_overrides(args.size))
    if args.xla_only:
        return _xla_main(args, argv, specs, dump, steps, started, load_before, tf)
    if args.largest_batch > 0:
        return _largest_batch_main(args, argv, device, started, load_before, tf)
    print(f"Benchmark: {len(specs)} model sizes x {len(runnable)} variants on "
          f"{device or 'the default device (CPU)'}; output in {args.out}/")
    rows = sweep.run_sweep(specs, runnable, steps=steps, budget_fraction=args.budget_fraction,
                           device=device, progress=not args.no_progress,
                           frontier=args.frontier, repeats=args.repeats)

    fit_results = None
    if args.cap_mb > 0 and "resnet" in _csv(args.models):
        fit_results = _fits(args, rows, specs, device, fits_lib, models)

    curves = None
    if args.train_steps > 0:
        strategy = args.train_strategy
        if strategy in __import__("memory_saving_gradients").available_strategies():
            size = training.QUICK_SIZE if args.quick else training.DEFAULT_SIZE
            print(f"Training check: {args.train_steps} SGD steps, tf.gradients vs '{strategy}' ...")
            curves = training.loss_curves(strategy, steps=args.train_steps, size=size)
        else:
            print(f"note: training check skipped: strategy {strategy!r} not available")

    extra = []
    if dump is not None:
        xla_results = _xla_results(args, specs, dump, steps)
        from . import xla as xla_lib

        extra.append(("XLA: temp memory and step time under jit_compile",
                      xla_lib.DESCRIPTION + "\n\n" + xla_lib.markdown_table(xla_results)))
    scaling_sizes = [int(x) for x in _csv(args.scaling_sizes) if x.lower() != "none"]
    if scaling_sizes:
        section = _scaling_section(scaling_sizes)
        if section:
            extra.append(("Rewrite time vs graph size (bench.rewrite_time)", section))
    wall = time.time() - started
    header = _header(args, argv, device, wall, load_before, tf)
    written = report.write_outputs(args.out, rows, fit_results, curves, extra, header=header)
    if dump is not None:
        written.update(xla_lib.write_outputs(args.out, xla_results, header=header))

    print()
    print(report.markdown_table(rows))
    exps = report.exponents(rows)
    if exps:
        print()
        print("Peak vs ResNet depth, fitted exponent: " +
              ", ".join(f"{v} {b:.2f}" for v, b in exps.items()))
    if fit_results:
        print()
        print(report.fits_table(fit_results))
    for title, body in extra:
        print()
        print(title + ":")
        print(body)
    if curves is not None:
        print()
        print(f"Training: {curves.steps} steps, largest relative loss difference "
              f"{curves.max_rel_diff:.2e}: {'same curve' if curves.same else 'CURVES DIFFER'}")
    print()
    print("Summary (peak and CPU time per step, as ratios to tf.gradients):")
    print(report.summary_table(rows))
    runs = sorted({row.run for row in rows})
    every = report.every_run_summary(rows) if len(runs) > 1 else []
    if every:
        print()
        print(f"Frontier checks in each of the {len(runs)} runs (results.md has the figures):")
        print(report.every_run_table(every, runs))
    print()
    print(f"Wall time {wall:.0f} s. Written: " + ", ".join(sorted(written.values())))
    bad = [r for r in rows if r.result.grads_equal is False]
    if bad:
        print("GRADIENTS DIFFER for: " + ", ".join(f"{r.model} {r.size} {r.variant}" for r in bad))
        return 1
    if curves is not None and not curves.same:
        return 1
    return 0


def _xla_results(args, specs, dump, steps) -> list:
    import memory_saving_gradients as msg

    from . import xla as xla_lib

    variants = _csv(args.xla_variants) if args.xla_variants else list(xla_lib.XLA_VARIANTS)
    unknown = [v for v in variants
               if v not in xla_lib.XLA_VARIANTS and v not in msg.available_strategies()]
    if unknown:
        raise SystemExit(f"unknown --xla-variants {unknown}; known: "
                         f"{', '.join(xla_lib.XLA_VARIANTS)} or a strategy name")
    print(f"XLA: {len(specs)} model sizes x {len(variants)} variants under jit_compile ...",
          flush=True)
    results = []
    for spec in specs:
        rows = xla_lib.measure_xla(spec, variants, dump=dump, steps=steps)
        for r in rows:
            print(f"  {r.model} {spec.size_label} {r.variant}: XLA temp "
                  f"{r.temp_bytes / MIB:.2f} MB, {r.step_seconds * 1e3:.1f} ms", flush=True)
        results.extend(rows)
    return results


def _xla_main(args, argv, specs, dump, steps, started, load_before, tf) -> int:
    from . import xla as xla_lib

    results = _xla_results(args, specs, dump, steps)
    wall = time.time() - started
    header = _header(args, argv, "", wall, load_before, tf)
    written = xla_lib.write_outputs(args.out, results, header=header)
    print()
    print(xla_lib.markdown_table(results))
    print()
    print(f"Wall time {wall:.0f} s. Written: " + ", ".join(sorted(written.values())))
    bad = xla_lib.differing(results)
    if bad:
        print("GRADIENTS DIFFER for: " + ", ".join(f"{r.model} {r.variant}" for r in bad))
        return 1
    return 0


def _largest_batch_main(args, argv, device, started, load_before, tf) -> int:
    from . import largest_batch

    print(f"Largest batch in {args.largest_batch:g} MB: {args.models}; output in {args.out}/")
    rows = largest_batch.run(_csv(args.models), args.largest_batch, quick=args.quick)
    header = _header(args, argv, device, time.time() - started, load_before, tf)
    written = largest_batch.write(args.out, rows, header)
    print()
    print(largest_batch.markdown(rows))
    print("\nwritten: " + ", ".join(written.values()))
    return 0 if all(r.fits is not False and not r.error for r in rows) else 1


def _quick_defaults(args) -> None:
    """Fill the options left unset: full defaults, or tiny ones with --quick."""
    for name, full, quick in (("steps", 8, 2), ("cap_mb", 48.0, 0.6), ("train_steps", 50, 5),
                              ("scaling_sizes", "2500", "none"),
                              ("fits_time_limit", DEFAULT_TIME_LIMIT, DEFAULT_TIME_LIMIT)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def _fits(args, rows, specs, device, fits_lib, models):
    from . import report

    resnet_specs = [s for s in specs if s.name == "resnet"]
    extra = {k: v for k, v in resnet_specs[0].size.items() if k not in ("depth", "batch")} if resnet_specs else {}
    fit_variants = [v for v in _csv(args.fits_variants)]
    if args.fits_over == "depth":
        batch = args.fits_batch or (resnet_specs[0].size.get("batch") if resnet_specs else 32)
        axis = fits_lib.resnet_depth_axis(k_max=8 if args.quick else 60)
        spec_for = lambda depth: models.resnet_spec(depth, batch, **extra)  # noqa: E731
        same_batch = all(s.size.get("batch") == batch for s in resnet_specs)
        known = report.series(rows, "resnet", "depth") if same_batch else {}
        what = f"ResNet depth at batch {batch}"
    else:
        depth = args.fits_depth
        # quick: even batches only; TF 2.21's oneDNN CPU kernels corrupt the heap on
        # some tiny odd-batch shapes (ResNet width 4, batch 1 or 3: a strided 1x1 conv's
        # gradients), which kills the process
        axis = (fits_lib.batch_axis(k_max=16, step=2) if args.quick
                else fits_lib.batch_axis(k_max=4096))
        spec_for = lambda b: models.resnet_spec(depth, b, **extra)  # noqa: E731
        known = {}
        what = f"batch of ResNet-{depth}"
    print(f"Fits in {args.cap_mb:g} MB: largest {what}, for {', '.join(fit_variants)} ...")
    found = fits_lib.fits_in(args.cap_mb, fit_variants, spec_for, axis, known=known, device=device,
                             budget_fraction=args.budget_fraction,
                             on_probe=lambda v, x, mb: print(
                                 f"  {v}: {axis.name} {x}: " + ("error" if mb is None else f"{mb:.1f} MB"),
                                 flush=True))
    if args.fits_time_limit > 0:
        print(f"Fits in {args.cap_mb:g} MB with the step at most {args.fits_time_limit:g}x "
              f"tf.gradients' CPU time: largest {what}, 'memory' with a budget chosen for the cap ...")
        found.append(fits_lib.fits_in_time(
            args.cap_mb, args.fits_time_limit, spec_for, axis,
            k_guess=fits_lib.time_guess_index(found, axis), device=device, steps=args.steps,
            on_probe=lambda p: print(f"  {axis.name} {p.value}: budget {p.budget_mb:.3g} MB, "
                                     + ("error" if p.peak_mb is None else f"{p.peak_mb:.1f} MB")
                                     + ("" if p.time_ratio is None else f", {p.time_ratio:.2f}x CPU time")
                                     + (f" (median of builds: {', '.join(f'{r:.2f}' for r in p.build_ratios)})"
                                        if p.build_ratios else ""),
                                     flush=True)))
        fits_lib.add_ratios(found)
    return found


def _scaling_section(sizes: List[int]) -> Optional[str]:
    from . import rewrite_time

    print(f"Rewrite time vs graph size ({', '.join(map(str, sizes))} ops) ...", flush=True)
    rows = rewrite_time.rewrite_times(sizes=sizes, on_row=lambda r: print(
        f"  {r['model']} {r['size_key']}={r['size']}: {r['ops']} ops, tf.gradients "
        f"{r['tf_seconds']:.2f} s, gradients() {r['ours_seconds']:.2f} s", flush=True))
    table = rewrite_time.markdown_table(rows)
    try:
        r = rewrite_time.in_fresh_process("warm_build_ratio")
    except RuntimeError as e:  # e.g. no test_models: no ResNet-110 row
        print(f"  no ResNet-110 build ratio: {str(e).splitlines()[0]}", flush=True)
        return table
    table += (f"\n\nResNet-{r['depth']} batch {r['batch']} ({r['ops']} ops), both warmed up, "
              f"best of {r.get('repeats', 2)}: tf.gradients {r['tf_seconds']:.3f} s, gradients(checkpoints="
              f"{r['checkpoints']!r}) {r['ours_seconds']:.3f} s: {r['ratio']:.2f}x.")
    return table


def _load() -> str:
    try:
        return "%.1f" % os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return "?"


def _header(args, argv, device, wall, load_before, tf) -> str:
    command = "python -m bench " + " ".join(
        argv if argv is not None else sys.argv[1:])
    return "\n".join([
        "# Benchmark results",
        "",
        f"- command: `{command.strip()}`",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; wall time {wall:.0f} s",
        f"- TensorFlow {tf.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, device: {device or 'default (CPU)'}; "
        f"1-min load average {load_before} at start, {_load()} at end",
        f"- peaks: measured from the allocator records of traced steps, the least and the most "
        f"of {core.PEAK_RUNS} (after one warm-up; the executor's op order moves the peak), "
        f"default ConfigProto, TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'unset')}; "
        "times: median of untraced steps, variants interleaved; ratios only "
        "between variants measured together in this run",
        "",
    ])

"""How long the rewrite takes on large graphs, next to ``tf.compat.v1.gradients``.

``rewrite_times()`` builds each model at graphs of about ``sizes`` ops (a
deep chain of small residual blocks, a very deep CIFAR ResNet, a many-layer
transformer, from ``test_models`` in a source checkout) and times, in one fresh
process per size (:func:`in_fresh_process`), TensorFlow's ``gradients`` building the backward pass and
``gradients(..., checkpoints=...)`` building the checkpointed one, each on a
freshly built copy of the same graph.  Model building is outside the timed
sections.  Times are CPU seconds of this process (``time.process_time``):
graph construction is single-threaded, and CPU time is far less disturbed
than wall time by other work on the machine.  Compare ratios measured in the
same run, never absolute seconds across runs.

Checkpoints: ``'memory'``.

Run ``python -m bench.rewrite_time`` for a markdown table (the
100k-op rows take several minutes each).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from memory_saving_gradients import checkpointing, memo
from memory_saving_gradients._tensorflow import tf, tf_gradients

from .models import test_models_package

logger = logging.getLogger("memory_saving_gradients")

DEFAULT_MODELS = ("chain", "resnet", "transformer")
DEFAULT_SIZES = (10_000, 100_000)
#: Issue 6's target: ``gradients()`` with checkpoints builds the backward pass in at
#: most this many times ``tf.gradients``' time on graphs of 10k-100k ops.  The tests
#: guard a looser bound (the ratio moves with the machine); the table says whether
#: each row of at least 10k ops meets this one.
RATIO_TARGET = 3.0
TARGET_FROM_OPS = 10_000


# ---- models -------------------------------------------------------------------------

def _builders() -> Dict[str, Tuple[str, int, Callable]]:
    """name -> (size keyword, smallest value, fn(value) -> (loss, xs, units)) in the default graph."""
    test_models = test_models_package()

    def chain(n):
        m = test_models.build("chain", kind="residual", n=int(n), size=16)
        return m.loss, list(m.inputs), list(m.units)

    def resnet(depth):
        m = test_models.build("resnet", depth=int(depth), batch=2, width=4)
        return m.loss, list(m.params), list(m.units)

    def transformer(layers):
        m = test_models.build("transformer", layers=int(layers), d_model=16, heads=2,
                              seq_len=8, vocab=32, batch=2)
        return m.loss, list(m.params), list(m.units)

    return {"chain": ("n", 8, chain), "resnet": ("depth", 8, resnet),
            "transformer": ("layers", 1, transformer)}


def _legal(model: str, value: int) -> int:
    if model == "resnet" and value >= 8:  # CIFAR ResNet depth is 6n + 2
        return 6 * max(1, round((value - 2) / 6)) + 2
    return max(1, int(round(value)))


def _count_ops(build: Callable, value: int) -> int:
    graph = tf.Graph()
    with graph.as_default():
        build(value)
    return len(graph.get_operations())


def sizes_for(model: str, targets: Sequence[int], builders=None) -> Tuple[str, List[int]]:
    """The size keyword, and the values that give about ``targets`` ops (fitted on two probes)."""
    builders = builders or _builders()
    key, low, build = builders[model]
    a, b = _legal(model, low), _legal(model, low * 4)
    ops_a, ops_b = _count_ops(build, a), _count_ops(build, b)
    per_unit = (ops_b - ops_a) / (b - a)
    return key, [max(_legal(model, a + (t - ops_a) / per_unit), a) for t in targets]


# ---- timing -------------------------------------------------------------------------

def _checkpoints_for(units: Sequence) -> Tuple[object, str]:
    """The checkpoints timed, and how the table names them: ``'memory'``."""
    return "memory", "'memory'"


def _timed(fn: Callable) -> float:
    gc.collect()
    start = time.process_time()
    fn()
    return time.process_time() - start


def _time_in_fresh_graph(build, value: int, choose) -> tuple:
    """Build the model in a graph of its own and time one gradients call on it:
    ``tf.gradients`` when ``choose`` is None, else ``gradients()`` with ``choose(units)``.
    Returns (forward ops, seconds, ops the call added, how the checkpoints were chosen)."""
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, units = build(value)
        ops = len(graph.get_operations())
        if choose is None:
            seconds, how = _timed(lambda: tf_gradients(loss, xs)), None
        else:
            checkpoints, how = choose(units)
            memo.forget()  # plan every time: a retrace of the same size would reuse the plan
            seconds = _timed(lambda: checkpointing.gradients(loss, xs, checkpoints=checkpoints))
        return ops, seconds, len(graph.get_operations()) - ops, how


def time_one(model: str, value: int, builders=None) -> dict:
    """Times for one model size: tf.gradients and gradients() on fresh copies of the graph."""
    builders = builders or _builders()
    key, _, build = builders[model]
    ops, tf_seconds, tf_added, _ = _time_in_fresh_graph(build, value, None)
    _, ours_seconds, ours_added, how = _time_in_fresh_graph(build, value, _checkpoints_for)
    gc.collect()
    return dict(model=model, size_key=key, size=value, ops=ops, checkpoints=how,
                tf_seconds=tf_seconds, ours_seconds=ours_seconds,
                ratio=ours_seconds / tf_seconds if tf_seconds > 0 else math.inf,
                tf_ops_added=tf_added, ours_ops_added=ours_added)


def warm_build_ratio(depth: int = 110, batch: int = 2, repeats: int = 3,
                     checkpoints: str = "memory") -> dict:
    """``gradients(..., checkpoints=...)`` against ``tf.gradients`` building the backward
    pass of a CIFAR ResNet (default ResNet-110, batch 2), both warmed up.

    One untimed build of each first (imports, TensorFlow's gradient registry,
    NumPy's first calls), then ``repeats`` builds of each, alternating, on
    fresh graphs; the best of each is kept (other work on a shared machine
    only ever adds time).  Remembered plans are forgotten before each build,
    so every timed build plans (a retrace of the same step would not).  CPU
    seconds (``time.process_time``), model building excluded.
    """
    import test_models  # a source checkout has it

    def one(ours: bool) -> Tuple[float, int]:
        memo.forget()  # plan every time: an identical retrace would reuse the plan
        graph = tf.Graph()
        with graph.as_default():
            model = test_models.build("resnet", depth=depth, batch=batch)
            ops = len(graph.get_operations())
            if ours:
                seconds = _timed(lambda: checkpointing.gradients(
                    model.loss, model.params, checkpoints=checkpoints))
            else:
                seconds = _timed(lambda: tf_gradients(model.loss, model.params))
        return seconds, ops

    one(False), one(True)
    tf_times, our_times = [], []
    for _ in range(max(1, repeats)):
        tf_times.append(one(False)[0])
        seconds, ops = one(True)
        our_times.append(seconds)
    tf_best, ours_best = min(tf_times), min(our_times)
    return dict(depth=depth, batch=batch, ops=ops, checkpoints=checkpoints, repeats=repeats,
                tf_seconds=tf_best, ours_seconds=ours_best, ratio=ours_best / tf_best)


_RESULT_MARK = "REWRITE_TIME_RESULT "


def in_fresh_process(function: str, timeout: float = 1800, **kwargs) -> dict:
    """``function(**kwargs)`` of this module, run in a fresh Python process; its dict.

    A process that has built many graphs before (the benchmark after its sweep and fits
    search, the test suite) times TensorFlow's own build faster and ours no faster: the
    benchmark sweep once read ResNet-110 at 3.79x where a fresh process read 2.75x, and a
    full test run 3.28x at 20k ResNet ops where fresh processes read 2.45x.  A fresh process measures what
    a user's process that builds its step once sees, so the benchmark and the tests time
    the rewrite here.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import json; from bench import rewrite_time as r; "
            f"print({_RESULT_MARK!r} + json.dumps(r.{function}(**{kwargs!r})))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=root, env=env, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT_MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"rewrite_time.{function}{kwargs} failed in a fresh process "
                           f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(_RESULT_MARK):])


def rewrite_times(models: Sequence[str] = DEFAULT_MODELS,
                  sizes: Sequence[int] = DEFAULT_SIZES,
                  on_row: Optional[Callable[[dict], None]] = None,
                  fresh: bool = True) -> List[dict]:
    """One dict per (model, size): ops, seconds for tf.gradients and for gradients(),
    their ratio, and (from the second size on) how time grew against ops.  ``fresh``:
    each size in a fresh process (:func:`in_fresh_process`), else in this one."""
    builders = _builders()
    rows: List[dict] = []
    for model in models:
        if model not in builders:
            logger.warning("scaling: no builder for model %r; skipped", model)
            continue
        previous = None
        _, values = sizes_for(model, sizes, builders)
        for target, value in zip(sizes, values):
            row = (in_fresh_process("time_one", model=model, value=int(value)) if fresh
                   else time_one(model, value, builders))
            row["target_ops"] = target
            if previous is not None:
                row["ops_growth"] = row["ops"] / previous["ops"]
                row["time_growth"] = row["ours_seconds"] / previous["ours_seconds"]
                row["tf_time_growth"] = row["tf_seconds"] / previous["tf_seconds"]
            rows.append(row)
            previous = row
            if on_row is not None:
                on_row(row)
    return rows


def _meets_target(row: dict) -> str:
    """'yes' / 'no' for a row of at least ``TARGET_FROM_OPS`` ops, '-' below."""
    if row["ops"] < TARGET_FROM_OPS:
        return "-"
    return "yes" if row["ratio"] <= RATIO_TARGET else "no"


def markdown_table(rows: Optional[List[dict]] = None, **kwargs) -> str:
    """The rows of :func:`rewrite_times` (run now if not given) as a markdown table."""
    if rows is None:
        rows = rewrite_times(**kwargs)
    lines = [
        "| model | size | ops | checkpoints | tf.gradients s | gradients() s | ratio | "
        f"within {RATIO_TARGET:g}x | ops growth | time growth (ours / tf) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        growth = (f"{r['ops_growth']:.1f}x" if "ops_growth" in r else "")
        time_growth = (f"{r['time_growth']:.1f}x / {r['tf_time_growth']:.1f}x"
                       if "time_growth" in r else "")
        lines.append(
            f"| {r['model']} | {r['size_key']}={r['size']} | {r['ops']} | {r['checkpoints']} | "
            f"{r['tf_seconds']:.2f} | {r['ours_seconds']:.2f} | {r['ratio']:.2f} | "
            f"{_meets_target(r)} | {growth} | {time_growth} |")
    lines.append("")
    lines.append("CPU seconds of graph construction (time.process_time), model building "
                 "excluded; each variant on a fresh copy of the graph. The target "
                 f"({RATIO_TARGET:g}x tf.gradients) holds for graphs of {TARGET_FROM_OPS:,} ops "
                 "and more; smaller rows say '-'.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(DEFAULT_SIZES))
    parser.add_argument("--resnet110", action="store_true",
                        help="only the warmed build ratio on ResNet-110, batch 2")
    args = parser.parse_args(argv)
    if args.resnet110:
        r = in_fresh_process("warm_build_ratio")
        print(f"ResNet-{r['depth']} batch {r['batch']} ({r['ops']} ops), warmed, "
              f"best of {r['repeats']}: tf.gradients {r['tf_seconds']:.3f} s, gradients(checkpoints="
              f"{r['checkpoints']!r}) {r['ours_seconds']:.3f} s: {r['ratio']:.2f}x")
        return
    rows = rewrite_times(args.models, args.sizes, on_row=lambda r: print(
        f"{r['model']} {r['size_key']}={r['size']}: {r['ops']} ops, tf {r['tf_seconds']:.2f} s, "
        f"ours {r['ours_seconds']:.2f} s ({r['ratio']:.2f}x)", flush=True))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()

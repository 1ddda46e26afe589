"""Where a step's time goes: kernel time by phase and op type, and time outside kernels.

``python -m bench.breakdown --models resnet --depths 110`` builds each variant
(:func:`bench.core.prepare`), then runs ``--steps`` fully traced steps of every
variant in turn, so that a change of machine load falls on all of them alike.
From each step's ``RunMetadata`` it takes every executed node's kernel
interval and sorts it into a phase by the name scope the graph gave it:

- ``recompute``: the rewrite's copies (scopes ``recompute_<i>``);
- ``backward``: gradient ops (scopes ``gradients``, ``backprop_<i>``,
  ``*_grad``, ``gradient_tape``);
- ``forward``: the rest (the forward pass, variable reads, the loss).

*Time outside kernels* is the step's wall time minus the union of all kernel
intervals: executor scheduling, Python and session overhead, and waits in
which no kernel runs.  *Nodes* counts the executed nodes of each phase (the
recompute phase's are the copies that ran, and the identities before their
inputs); *overlap* is the kernel time summed over threads over the time some
kernel runs: how many kernels run side by side, on average.  Figures are medians over the traced steps; the spread
of a figure is its interquartile range over its median.  Tracing adds its own cost
to every node, the same for every variant, so compare variants within one
run, never against untraced step times.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import statistics
import sys
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

PHASES = ("forward", "recompute", "backward")

#: Name-scope components of gradient ops: the rewrite's and TensorFlow's gradient functions,
#: the tape's.  They may sit inside a copy's scope (the gradient of a recomputed op).
_GRADIENT_SCOPE = re.compile(r"^(backprop_\d+|gradient_tape|.*_grad)$")
#: Name-scope components of the rewrite's recomputed copies.
_RECOMPUTE_SCOPE = re.compile(r"^recompute_\d+$")
#: The top scope of a ``tf.gradients`` call (everything it adds that is no gradient function).
_GRADIENTS_CALL = re.compile(r"^gradients(_\d+)?$")
#: A node's timeline label: ``name = OpType(inputs)``.
_LABEL = re.compile(r"^[^=]*=\s*([A-Za-z0-9_]+)\(")


def phase_of(node_name: str) -> str:
    """The phase of an executed node, from the name scopes of its name."""
    scopes = node_name.split("/")[:-1]
    if any(_GRADIENT_SCOPE.match(p) for p in scopes):
        return "backward"
    if any(_RECOMPUTE_SCOPE.match(p) for p in scopes):
        return "recompute"
    if any(_GRADIENTS_CALL.match(p) for p in scopes):
        return "backward"
    return "forward"


def op_type_of(timeline_label: str) -> str:
    """The op type in a node's timeline label, without oneDNN's ``_Mkl`` prefixes."""
    match = _LABEL.match(timeline_label or "")
    kind = match.group(1) if match else "?"
    return kind.replace("_MklNative", "").replace("_Mkl", "")


def busy_seconds(intervals: Iterable[Tuple[int, int]]) -> float:
    """Seconds covered by the union of ``[start, end)`` intervals in microseconds."""
    total, end_so_far = 0, None
    for start, end in sorted(intervals):
        if end_so_far is None or start > end_so_far:
            total += end - start
            end_so_far = end
        elif end > end_so_far:
            total += end - end_so_far
            end_so_far = end
    return total / 1e6


@dataclasses.dataclass
class StepTimes:
    """One traced step: kernel seconds per (phase, op type), busy and wall seconds."""

    kernel: Dict[Tuple[str, str], float]
    nodes: Dict[str, int]
    busy: float
    wall: float

    @property
    def outside(self) -> float:
        return max(0.0, self.wall - self.busy)

    def phase_kernel(self, phase: str) -> float:
        return sum(v for (p, _), v in self.kernel.items() if p == phase)


def step_times(run_metadata, wall_seconds: float) -> StepTimes:
    """Sort one step's node stats into phases and op types."""
    kernel: Dict[Tuple[str, str], float] = collections.defaultdict(float)
    nodes: Dict[str, int] = collections.Counter()
    intervals = []
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            if node.node_name == "_SOURCE":
                continue
            start = node.all_start_micros + node.op_start_rel_micros
            end = node.all_start_micros + max(node.op_end_rel_micros, node.op_start_rel_micros)
            phase = phase_of(node.node_name)
            kernel[(phase, op_type_of(node.timeline_label))] += (end - start) / 1e6
            nodes[phase] += 1
            intervals.append((start, end))
    return StepTimes(dict(kernel), dict(nodes), busy_seconds(intervals), wall_seconds)


@dataclasses.dataclass
class Breakdown:
    """A variant's traced steps, summarised by medians and spreads."""

    variant: str
    steps: List[StepTimes]

    def median(self, figure) -> float:
        return statistics.median(figure(s) for s in self.steps)

    def spread(self, figure) -> Optional[float]:
        """The interquartile range of a figure over its median (None for under 4 steps)."""
        values = [figure(s) for s in self.steps]
        middle = statistics.median(values)
        if middle <= 0 or len(values) < 4:
            return None
        low, _, high = statistics.quantiles(values, n=4)
        return (high - low) / middle

    def op_types(self, phase: str) -> Dict[str, float]:
        """Median kernel seconds per op type within one phase."""
        kinds = {k for s in self.steps for (p, k) in s.kernel if p == phase}
        return {k: statistics.median(s.kernel.get((phase, k), 0.0) for s in self.steps)
                for k in kinds}


FIGURES = {
    "wall": lambda s: s.wall,
    "kernels": lambda s: sum(s.kernel.values()),
    "forward": lambda s: s.phase_kernel("forward"),
    "recompute": lambda s: s.phase_kernel("recompute"),
    "backward": lambda s: s.phase_kernel("backward"),
    "outside": lambda s: s.outside,
}

#: Counted per step, besides the timed figures.
COUNTS = {
    "forward nodes": lambda s: s.nodes.get("forward", 0),
    "recompute nodes": lambda s: s.nodes.get("recompute", 0),
    "backward nodes": lambda s: s.nodes.get("backward", 0),
    "overlap": lambda s: sum(s.kernel.values()) / s.busy if s.busy else 0.0,
}


def measure(prepared: Sequence, steps: int = 10, warmup: int = 1) -> List[Breakdown]:
    """``warmup`` untraced rounds, then ``steps`` traced rounds of every ready variant in turn."""
    ready = [p for p in prepared if p.ready]
    for _ in range(warmup):
        for p in ready:
            p.step(record=False)
    traced = {id(p): [] for p in ready}
    for _ in range(steps):
        for p in ready:
            metadata, seconds = p.traced_step()
            traced[id(p)].append(step_times(metadata, seconds))
    return [Breakdown(p.result.variant, traced[id(p)]) for p in ready]


def table(breakdowns: Sequence[Breakdown], baseline: str = "tf.gradients") -> str:
    """Markdown: per variant, milliseconds (spread) of each figure and its ratio to the baseline's."""
    base = next((b for b in breakdowns if b.variant == baseline), None)
    head = ["variant"] + [f"{name} ms (spread)" for name in FIGURES] + [
        f"{name} / {baseline}" for name in ("wall", "backward", "outside")] + list(COUNTS)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in breakdowns:
        cells = [b.variant]
        for figure in FIGURES.values():
            spread = b.spread(figure)
            cells.append(f"{1e3 * b.median(figure):.1f}"
                         + (f" ({100 * spread:.0f}%)" if spread is not None else ""))
        for name in ("wall", "backward", "outside"):
            denominator = base.median(FIGURES[name]) if base else 0.0
            cells.append(f"{b.median(FIGURES[name]) / denominator:.2f}x" if denominator else "-")
        for name, count in COUNTS.items():
            value = b.median(count)
            cells.append(f"{value:.2f}" if name == "overlap" else f"{value:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def op_type_table(breakdowns: Sequence[Breakdown], phase: str = "backward", top: int = 12,
                  baseline: str = "tf.gradients") -> str:
    """Markdown: the ``top`` op types by the baseline's kernel time in ``phase`` (by the
    largest of any variant's, for a phase the baseline lacks), per variant."""
    per_variant = {b.variant: b.op_types(phase) for b in breakdowns}
    base = per_variant.get(baseline) or {}
    if not base:
        for times in per_variant.values():
            for kind, seconds in times.items():
                base[kind] = max(base.get(kind, 0.0), seconds)
    kinds = sorted(base, key=base.get, reverse=True)[:top]
    head = ["op type"] + [f"{v} ms" for v in per_variant]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in kinds:
        lines.append("| " + " | ".join(
            [kind] + [f"{1e3 * per_variant[v].get(kind, 0.0):.1f}" for v in per_variant]) + " |")
    return "\n".join(lines)


def plot(breakdowns: Sequence[Breakdown], path: str, title: str = "") -> Optional[str]:
    """Stacked bars: median kernel seconds per phase and time outside kernels, per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the bench extra brings it
        return None
    figure, axis = plt.subplots(figsize=(1.6 + 1.1 * len(breakdowns), 4))
    bottoms = [0.0] * len(breakdowns)
    for part in ("forward", "recompute", "backward", "outside"):
        heights = [1e3 * b.median(FIGURES[part]) for b in breakdowns]
        axis.bar([b.variant for b in breakdowns], heights, bottom=bottoms, label=part)
        bottoms = [x + h for x, h in zip(bottoms, heights)]
    axis.set_ylabel("ms per traced step (kernel time, summed over threads)")
    axis.set_title(title)
    axis.legend()
    axis.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    from . import core, models

    parser = argparse.ArgumentParser(prog="python -m bench.breakdown", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet")
    parser.add_argument("--depths", default="110", help="ResNet depths")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--size", action="append", default=[], metavar="MODEL.KEY=VALUE")
    parser.add_argument("--variants", default="tf.gradients,recompute_grad,collection,memory")
    parser.add_argument("--steps", type=int, default=10, help="traced steps per variant")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    specs = models.specs(args.models.split(","), quick=args.quick,
                         depths=None if args.quick else [int(d) for d in args.depths.split(",")],
                         batch=args.batch, overrides=models.parse_overrides(args.size))
    os.makedirs(args.out, exist_ok=True)
    sections = []
    for spec in specs:
        prepared = [core.prepare(spec, v, predict=False) for v in args.variants.split(",")]
        try:
            breakdowns = measure(prepared, steps=args.steps)
        finally:
            for p in prepared:
                p.close()
        label = f"{spec.name} {spec.size_label}"
        name = f"breakdown_{spec.name}_{len(sections)}.png"
        plot(breakdowns, os.path.join(args.out, name), label)
        sections.append(f"## {label}\n\n{table(breakdowns)}\n\nBackward kernels by op type:\n\n"
                        f"{op_type_table(breakdowns)}\n\nRecomputed kernels by op type:\n\n"
                        f"{op_type_table(breakdowns, phase='recompute')}\n\n![{label}]({name})\n")
        print(sections[-1], flush=True)
    with open(os.path.join(args.out, "breakdown.md"), "w", encoding="utf-8") as handle:
        command = " ".join(sys.argv[1:] if argv is None else argv)
        handle.write(f"# Where the step time goes ({args.steps} traced steps per variant)\n\n"
                     f"- command: `python -m bench.breakdown {command}`\n"
                     "- spread: the interquartile range of a figure over its median; kernel times "
                     "are summed over the executor's threads, so they may exceed the wall time\n\n"
                     + "\n".join(sections))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    raise SystemExit(main())

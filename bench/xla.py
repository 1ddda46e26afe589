"""XLA's own memory for one training step: plain vs recomputation, under ``jit_compile``.

XLA allocates one preallocated temporary buffer per compiled computation
(its buffer assignment packs every intermediate into it), which no
TensorFlow allocator record shows.  Its size is in the memory-usage report
that ``--xla_dump_to`` writes; :class:`XlaDump` switches that dump on (it
must be set before the process compiles anything with XLA) and reads back
the reports of each new compilation.

``measure_xla(module, size, variants)`` builds a ``test_models``-style
model eagerly (variables outside the step), compiles one gradient step per
variant with ``tf.function(jit_compile=True)`` and returns, per variant, XLA
temp bytes, median step time, gradient error against ``tf.gradients``
without XLA, and, for the library's variants, ``plan()``'s predicted peak.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import shutil
import statistics
import tempfile
import time
from typing import Optional, Sequence

import numpy as np

from memory_saving_gradients._tensorflow import tf, tf_gradients
from memory_saving_gradients._units import GIB, KIB, MIB

logger = logging.getLogger("bench")

#: Variants of the XLA comparison, in table order.
XLA_VARIANTS = ("tf.gradients", "recompute_grad", "collection", "memory")

_UNITS = {"B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB}


def _allocations(text: str, kind: str) -> list:
    """Byte sizes of the allocations of ``kind`` ("preallocated-temp", "maybe-live-out")
    in the per-allocation section of an XLA memory-usage report (sizes are printed
    in bytes or, rounded to three figures, in KiB/MiB/GiB)."""
    marker = "Allocations sorted by size with their values:"
    if marker in text:
        text = text[text.index(marker):]
    sizes = []
    for value, unit in re.findall(
        rf"^allocation \d+: size ([\d.]+)(B|KiB|MiB|GiB)?,[^\n]*\b{kind}:", text, re.M
    ):
        sizes.append(int(round(float(value) * _UNITS[unit or "B"])))
    return sizes


def temp_bytes_of_report(text: str) -> int:
    """The preallocated temp bytes of one XLA memory-usage report (0 if none)."""
    return max(_allocations(text, "preallocated-temp"), default=0)


def live_out_bytes_of_report(text: str) -> int:
    """Bytes of the computation's outputs (the returned gradients) in one report."""
    return sum(_allocations(text, "maybe-live-out"))


class XlaDump:
    """Reads XLA's memory-usage reports of the computations compiled from now on.

    Adds ``--xla_dump_to`` to ``XLA_FLAGS`` (kept if one is already there):
    XLA reads the flags once, at its first compilation, so create this
    before anything in the process is compiled with XLA.  A folder it makes
    itself (neither ``directory`` nor the flag names one) is removed when the
    process exits: XLA dumps every pass of every computation there, tens of
    MB per model.
    """

    def __init__(self, directory: Optional[str] = None):
        flags = os.environ.get("XLA_FLAGS", "")
        match = re.search(r"--xla_dump_to=(\S+)", flags)
        if match:
            self.directory = match.group(1)
        else:
            self.directory = directory
            if directory is None:
                self.directory = tempfile.mkdtemp(prefix="msg_xla_dump_")
                atexit.register(shutil.rmtree, self.directory, ignore_errors=True)
            os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={self.directory}".strip()
        os.makedirs(self.directory, exist_ok=True)
        self._seen = set(os.listdir(self.directory))

    def new_reports(self) -> list:
        """``(temp bytes, output bytes)`` of each computation compiled since the last
        call, largest temp first."""
        files = set(os.listdir(self.directory))
        new = sorted(f for f in files - self._seen if f.endswith("memory-usage-report.txt"))
        self._seen = files
        reports = []
        for name in new:
            with open(os.path.join(self.directory, name)) as f:
                text = f.read()
            reports.append((temp_bytes_of_report(text), live_out_bytes_of_report(text)))
        return sorted(reports, reverse=True)

    def new_temp_bytes(self) -> list:
        """Temp bytes of each computation compiled since the last call, largest first."""
        return [temp for temp, _ in self.new_reports()]


@dataclasses.dataclass
class XlaResult:
    """One model x variant under ``tf.function(jit_compile=True)``."""

    model: str
    size: dict
    variant: str
    temp_bytes: int
    step_seconds: float
    output_bytes: int
    max_rel_error: float
    max_rel_error_vs_xla: Optional[float] = None
    predicted_peak_bytes: Optional[int] = None
    baseline_predicted_bytes: Optional[int] = None


def gradient_step(functional, params, variant: str, jit_compile: bool = True):
    """A ``tf.function`` returning the gradients of the model's loss, computed by ``variant``.

    ``functional`` is a :class:`~bench.core.Functional`
    (``forward(params, *inputs, unit_wrapper=None) -> (loss, units)``).
    """
    import memory_saving_gradients as msg

    trainable = _trainable(params)

    @tf.function(jit_compile=jit_compile, autograph=False)
    def step(*inputs):
        if variant == "recompute_grad":
            with tf.GradientTape() as tape:
                loss, _ = functional.forward(params, *inputs, unit_wrapper=tf.recompute_grad)
            return tape.gradient(loss, trainable)
        loss, units = functional.forward(params, *inputs)
        if variant == "tf.gradients":
            return tf_gradients(loss, trainable)
        if variant == "collection":
            return msg.gradients(loss, trainable, checkpoints=list(units))
        return msg.gradients(loss, trainable, checkpoints=variant)

    return step


def planned_peaks(functional, params, inputs, strategy: str = "memory") -> tuple:
    """``plan()``'s predicted peak and plain baseline for the step, traced for XLA."""
    import memory_saving_gradients as msg

    trainable = _trainable(params)
    box = {}

    @tf.function(jit_compile=True, autograph=False)
    def trace(*xs):
        loss, units = functional.forward(params, *xs)
        box["plan"] = msg.plan(
            loss, trainable, checkpoints=list(units) if strategy == "collection" else strategy
        )
        return loss

    trace.get_concrete_function(*inputs)
    plan = box["plan"]
    return plan.predicted_peak_bytes, plan.baseline_peak_bytes


def measure_xla(
    spec,
    variants: Sequence[str] = XLA_VARIANTS,
    dump: Optional[XlaDump] = None,
    steps: int = 5,
) -> list:
    """:class:`XlaResult` s of one model (a ``bench.core.ModelSpec`` with a ``functional``).

    Each variant's step is compiled once (its XLA memory report read), then
    all are timed in ``steps`` rounds of one call each (median); gradients are compared with
    ``tf.gradients`` without XLA and with plain ``tf.gradients`` under XLA.
    """
    dump = dump or XlaDump()
    functional = spec.functional
    params = functional.make_params()
    inputs = [tf.constant(v) for v in functional.inputs]
    reference = _values(gradient_step(functional, params, "tf.gradients", False)(*inputs))
    compiled = []
    for variant in variants:
        step = gradient_step(functional, params, variant)
        dump.new_reports()
        grads = _values(step(*inputs))
        reports = dump.new_reports()
        if not reports:
            raise RuntimeError(
                f"XLA wrote no memory report for {variant}: create XlaDump before the "
                "process compiles anything with XLA."
            )
        compiled.append((variant, step, grads, reports[0]))
    # Timed in rounds, one call of each variant per round, so that a change in the
    # machine's load hits every variant alike.
    times: dict = {variant: [] for variant in variants}
    for _ in range(max(steps, 0)):
        for variant, step, _, _ in compiled:
            start = time.perf_counter()
            _values(step(*inputs))
            times[variant].append(time.perf_counter() - start)
    xla_plain = next((g for v, _, g, _ in compiled if v == "tf.gradients"), None)
    results = []
    for variant, _, grads, (temp, outputs) in compiled:
        predicted = baseline = None
        if variant in ("memory", "collection"):
            predicted, baseline = planned_peaks(functional, params, inputs, variant)
        results.append(XlaResult(
            model=spec.name, size=dict(spec.size), variant=variant, temp_bytes=temp,
            output_bytes=outputs,
            step_seconds=statistics.median(times[variant]) if times[variant] else float("nan"),
            max_rel_error=_max_rel_error(grads, reference),
            max_rel_error_vs_xla=None if xla_plain is None else _max_rel_error(grads, xla_plain),
            predicted_peak_bytes=predicted, baseline_predicted_bytes=baseline,
        ))
        logger.info("xla %s %s: temp %d B, %.4f s", spec.name, variant, temp,
                    results[-1].step_seconds)
    return results


def differing(results, floor: float = 1e-3) -> list:
    """Results whose gradients differ from plain ``tf.gradients`` under XLA by more than
    XLA's own rounding: ``floor``, or twice the distance between plain ``tf.gradients``
    with and without XLA on the same model (batch norm in training mode makes that
    distance reach 1e-2 on a CIFAR ResNet)."""
    noise = {(r.model, tuple(sorted(r.size.items()))): r.max_rel_error
             for r in results if r.variant == "tf.gradients"}
    bad = []
    for r in results:
        if r.max_rel_error_vs_xla is None:
            continue
        limit = max(floor, 2 * noise.get((r.model, tuple(sorted(r.size.items()))), 0.0))
        if r.max_rel_error_vs_xla > limit:
            bad.append(r)
    return bad


def _trainable(params) -> list:
    return list(getattr(params, "trainable", params))


def _values(gradients) -> list:
    """Numpy values of gradients, ``IndexedSlices`` made dense."""
    return [np.asarray(tf.convert_to_tensor(g)) for g in gradients]


def _max_rel_error(values, reference) -> float:
    """Largest absolute difference of each gradient, relative to its largest reference entry."""
    return max(
        (float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)
         for a, b in zip(values, reference) if b.size),
        default=0.0,
    )


# ------------------------------------------------------------------ report


def _by_model(results) -> dict:
    """``{(model, size label): {variant: XlaResult}}`` in measuring order."""
    groups: dict = {}
    for r in results:
        label = " ".join(f"{k}={v}" for k, v in r.size.items())
        groups.setdefault((r.model, label), {})[r.variant] = r
    return groups


def table_rows(results) -> list:
    """One dict per result, with ratios against plain ``tf.gradients`` under XLA."""
    rows = []
    for (model, label), variants in _by_model(results).items():
        plain = variants.get("tf.gradients")
        for variant, r in variants.items():
            rows.append({
                "model": model, "size": label, "variant": variant,
                "xla_temp_mb": r.temp_bytes / MIB,
                "temp_ratio": r.temp_bytes / plain.temp_bytes if plain and plain.temp_bytes else None,
                "step_ms": r.step_seconds * 1e3,
                "time_ratio": (r.step_seconds / plain.step_seconds
                               if plain and plain.step_seconds > 0 else None),
                "predicted_mb": (None if r.predicted_peak_bytes is None
                                 else r.predicted_peak_bytes / MIB),
                "predicted_over_xla": (None if r.predicted_peak_bytes is None
                                       else r.predicted_peak_bytes / max(r.temp_bytes, 1)),
                "xla_outputs_mb": r.output_bytes / MIB,
                "predicted_over_xla_with_outputs": (
                    None if r.predicted_peak_bytes is None
                    else r.predicted_peak_bytes / max(r.temp_bytes + r.output_bytes, 1)),
                "max_rel_error": r.max_rel_error,
                "max_rel_error_vs_xla": r.max_rel_error_vs_xla,
            })
    return rows


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return format(value, fmt)


def markdown_table(results) -> str:
    """XLA temp and step time per model and variant, ratios against plain under XLA."""
    lines = [
        "| model | size | variant | XLA temp MB | vs plain | step ms | time vs plain "
        "| plan() MB | plan / temp | plan / (temp + out) | grad err vs tf.gradients "
        "(no XLA / XLA) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in table_rows(results):
        lines.append(
            f"| {row['model']} | {row['size']} | {row['variant']} | {row['xla_temp_mb']:.2f} "
            f"| {_cell(row['temp_ratio'], '.3f')} | {_cell(row['step_ms'], '.1f')} "
            f"| {_cell(row['time_ratio'], '.2f')} | {_cell(row['predicted_mb'], '.2f')} "
            f"| {_cell(row['predicted_over_xla'], '.2f')} "
            f"| {_cell(row['predicted_over_xla_with_outputs'], '.2f')} "
            f"| {_cell(row['max_rel_error'], '.1e')} / {_cell(row['max_rel_error_vs_xla'], '.1e')} |"
        )
    return "\n".join(lines)


def write_csv(results, path: str) -> None:
    import csv

    rows = table_rows(results)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["model"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def plot(results, path: str) -> Optional[str]:
    """Grouped bars: XLA temp of each variant as a fraction of plain, per model."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in table_rows(results) if r["temp_ratio"] is not None]
    if not rows:
        return None
    groups = list(dict.fromkeys(f"{r['model']}\n{r['size']}" for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(groups) + 2), 4.8))
    for i, variant in enumerate(variants):
        xs, ys, labels = [], [], []
        for j, group in enumerate(groups):
            match = [r for r in rows if f"{r['model']}\n{r['size']}" == group
                     and r["variant"] == variant]
            if match:
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                ys.append(match[0]["temp_ratio"])
                labels.append(match[0]["time_ratio"])
        bars = ax.bar(xs, ys, width, label=variant)
        for bar, t in zip(bars, labels):
            if t is not None:
                ax.annotate(f"{t:.2f}x t", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g.replace(" ", "\n", 2) for g in groups], fontsize=7)
    ax.set_ylabel("XLA temp bytes / plain tf.gradients under XLA")
    ax.set_title("tf.function(jit_compile=True): XLA temp memory (labels: step time ratio)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(out_dir: str, results, header: str = "") -> dict:
    """xla.json, xla.csv, xla.md and xla_temp.png in ``out_dir``; returns ``{kind: path}``."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    written = {}
    path = os.path.join(out_dir, "xla.json")  # raw results first: the rest is derived
    with open(path, "w") as f:
        json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    written["xla_json"] = path
    path = os.path.join(out_dir, "xla.csv")
    write_csv(results, path)
    written["xla_csv"] = path
    png = plot(results, os.path.join(out_dir, "xla_temp.png"))
    if png:
        written["xla_png"] = png
    md = [header] if header else []
    md += ["## XLA: temp memory and step time under tf.function(jit_compile=True)", "",
           DESCRIPTION, "", markdown_table(results), ""]
    if png:
        md.append(f"![XLA temp]({os.path.basename(png)})")
    path = os.path.join(out_dir, "xla.md")
    with open(path, "w") as f:
        f.write("\n".join(md).rstrip() + "\n")
    written["xla_md"] = path
    return written


DESCRIPTION = (
    "XLA temp: the preallocated temp buffer of XLA's buffer assignment for the compiled "
    "gradient step (from the --xla_dump_to memory-usage report; parameters and the "
    "gradients it returns are not in it). Step time: median of untraced calls after "
    "compiling, ratio against plain tf.gradients under XLA in the same run. plan() MB: "
    "memory_saving_gradients.plan()'s predicted peak for the same checkpoints; out: the "
    "computation's outputs (the gradients, live at its end), which plan() counts and XLA's "
    "temp does not."
)

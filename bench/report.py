"""Tables and plots of a benchmark run: CSV, Markdown, PNG.

Plots need matplotlib (the ``bench`` extra); without it the tables are
still written and the plots are skipped with a note.
"""

from __future__ import annotations

import csv
import math
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from memory_saving_gradients._units import MIB

FRONTIER = "frontier"
#: Variants a frontier is compared with (the anchors), besides tf.gradients.  'memory'
#: is not one: it is the frontier's least-peak end.
ANCHORS = ("recompute_grad", "grappler-recompute", "collection", "speed")
#: Two time ratios count as "not slower" within this many times the group's noise
#: (of the same clock: CPU or wall time).
NOISE_MULTIPLE = 2
#: 'memory' costs at most RECOMPUTE_COST_FACTOR times its predicted recomputation
#: (plan()'s predicted step-time ratio minus 1) plus RECOMPUTE_COST_SLACK of a step.
RECOMPUTE_COST_FACTOR = 1.1
RECOMPUTE_COST_SLACK = 0.03
#: 'memory' counts as the least peak when within this of every other variant's.
LEAST_PEAK_SLACK = 0.03
#: plan()'s predicted step-time ratio is checked against the measured one within this fraction.
TIME_PREDICTION_TOLERANCE = 0.10
#: A frontier point "peaks no higher" than an anchor within this (measured peaks of
#: the same graph move by about this much between runs).
PEAK_JITTER = 0.01

COLUMNS = [
    "model", "size", "batch", "variant", "peak_mb", "peak_max_mb", "peak_ratio", "step_s",
    "time_ratio",
    "cpu_ratio", "predicted_time_ratio", "rewrite_s", "predicted_peak_mb", "grads_equal", "note",
]
#: results.csv has these too: which run of ``--repeats`` and the spread of the step times.
CSV_COLUMNS = ["run"] + COLUMNS[:10] + ["step_spread", "cpu_spread"] + COLUMNS[10:]

HEADERS = {
    "model": "model", "size": "size", "batch": "batch", "variant": "variant",
    "peak_mb": "peak MB (least of 3 runs)", "peak_max_mb": "most of 3", "peak_ratio": "peak / tf.gradients",
    "step_s": "step s (median)", "run": "run",
    "step_spread": "step time spread", "cpu_spread": "CPU time spread",
    "time_ratio": "time / tf.gradients", "cpu_ratio": "CPU time / tf.gradients",
    "predicted_time_ratio": "plan() time / tf.gradients",
    "rewrite_s": "rewrite s",
    "predicted_peak_mb": "plan() predicted MB", "grads_equal": "grads equal", "note": "note",
}


def fit_power_law(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """(exponent b, scale a) of the least-squares fit ``y = a * x**b`` in log-log space."""
    x = np.log(np.asarray(xs, dtype=np.float64))
    y = np.log(np.asarray(ys, dtype=np.float64))
    if x.size < 2 or np.ptp(x) == 0:
        raise ValueError("a power-law fit needs at least two distinct x values")
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(math.exp(intercept))


def row_dict(row) -> Dict[str, object]:
    """A sweep Row as a flat dict of the table's columns (numbers unformatted)."""
    res = row.result
    note = ""
    if res.error:
        note = _short_error(res.error)
    elif res.budget_bytes:
        note = f"budget {res.budget_bytes / MIB:.1f} MB"
    if getattr(res, "gradient_retries", 0):
        retried = f"gradient check repeated {res.gradient_retries}x (nondeterministic kernels)"
        note = f"{note}; {retried}" if note else retried
    return {
        "run": getattr(row, "run", 1),
        "model": res.model,
        "size": res.size,
        "batch": res.batch,
        "variant": res.variant,
        "peak_mb": None if res.peak_bytes is None else res.peak_bytes / MIB,
        "peak_max_mb": None if res.peak_max_bytes is None else res.peak_max_bytes / MIB,
        "peak_ratio": row.peak_ratio,
        "step_s": res.median_step_seconds,
        "time_ratio": row.time_ratio,
        "cpu_ratio": getattr(row, "cpu_ratio", None),
        "step_spread": getattr(res, "step_spread", None),
        "cpu_spread": getattr(res, "cpu_spread", None),
        "predicted_time_ratio": res.predicted_time_ratio,
        "rewrite_s": res.rewrite_seconds if res.ok else None,
        "predicted_peak_mb": (None if res.predicted_peak_bytes is None
                              else res.predicted_peak_bytes / MIB),
        "grads_equal": None if res.grads_equal is None else ("yes" if res.grads_equal else "NO"),
        "note": note,
    }


def _short_error(error: str) -> str:
    if "memory_budget" in error and "cannot be met" in error:
        tail = error.split("smallest peak", 1)[-1]
        mb = tail.split("MB", 1)[0].split()[-1] if "MB" in tail else "?"
        return f"budget infeasible (smallest peak plan() finds: {mb} MB)"
    return error[:160]


def _fmt(column: str, value) -> str:
    if value is None:
        return ""
    if column in ("peak_mb", "peak_max_mb", "predicted_peak_mb"):
        return f"{value:.1f}"
    if column in ("peak_ratio", "time_ratio", "cpu_ratio", "predicted_time_ratio"):
        return f"{value:.3f}x" if column == "peak_ratio" else f"{value:.2f}x"
    if column in ("step_s", "rewrite_s"):
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    return str(value)


def write_csv(rows, path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            d = row_dict(row)
            writer.writerow({k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v))
                             for k, v in d.items()})


def markdown(columns: Sequence[str], headers: Dict[str, str], records, fmt) -> str:
    """A Markdown table: one row per dict of ``records``, cells ``fmt(column, value)``."""
    lines = ["| " + " | ".join(headers[c] for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for d in records:
        lines.append("| " + " | ".join(fmt(c, d[c]) for c in columns) + " |")
    return "\n".join(lines)


def markdown_table(rows, columns: Sequence[str] = COLUMNS) -> str:
    """The rows as Markdown; with rows of several runs (``--repeats``), a run column first."""
    if len(_runs(rows)) > 1 and "run" not in columns:
        columns = ["run"] + list(columns)
    return markdown(columns, HEADERS, (row_dict(row) for row in rows), _fmt)


def _runs(rows) -> List[int]:
    """The runs (``--repeats``) the rows come from, in order."""
    return sorted({getattr(row, "run", 1) for row in rows})


#: Variants the terminal summary shows, when the sweep measured them.
SUMMARY_VARIANTS = ("memory", "recompute_grad", "collection", "speed")


def summary_table(rows) -> str:
    """One line per model size: plain's peak, then peak and CPU-time ratios of
    the main variants (the short table printed at the end of a run)."""
    by_model: Dict[Tuple[str, str], Dict[str, Dict[str, object]]] = {}
    several = len(_runs(rows)) > 1
    for row in rows:
        d = row_dict(row)
        size = f"{d['size']} (run {d['run']})" if several else d["size"]
        by_model.setdefault((d["model"], size), {})[d["variant"]] = d
    variants = [v for v in SUMMARY_VARIANTS if any(v in m for m in by_model.values())]
    lines = ["| model | size | tf.gradients MB | " + " | ".join(
        f"{v}: peak, CPU time" for v in variants) + " |",
             "|" + "|".join("---" for _ in range(3 + len(variants))) + "|"]
    for (model, size), found in by_model.items():
        plain = found.get("tf.gradients", {}).get("peak_mb")
        cells = []
        for v in variants:
            d = found.get(v)
            if d is None or d["peak_ratio"] is None:
                cells.append("-")
                continue
            cpu = d.get("cpu_ratio") or d.get("time_ratio")
            cells.append(f"{d['peak_ratio']:.3f}x, " + ("-" if cpu is None else f"{cpu:.2f}x"))
        lines.append(f"| {model} | {size} | " + ("-" if plain is None else f"{plain:.1f}")
                     + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def exponents(rows, model: str = "resnet", key: str = "depth") -> Dict[str, float]:
    """Per variant, the fitted exponent of peak vs ``key`` (needs >= 2 sizes)."""
    out = {}
    for variant, points in series(rows, model, key).items():
        if len({x for x, _ in points}) >= 2:
            out[variant] = fit_power_law([x for x, _ in points], [y for _, y in points])[0]
    return out


def series(rows, model: str = "resnet", key: str = "depth") -> Dict[str, List[Tuple[float, float]]]:
    """Per variant, sorted (size value, peak MB) points of one model with the same other sizes
    (the least peak of a size measured in several runs)."""
    out: Dict[str, List[Tuple[float, float]]] = {}
    for row in rows:
        res = row.result
        if res.model != model or not res.ok or res.variant == FRONTIER:
            continue
        value = _size_value(res.size, key)
        if value is None:
            continue
        out.setdefault(res.variant, []).append((value, res.peak_bytes / MIB))
    return {v: _least_per_value(p) for v, p in out.items()}


def _least_per_value(points: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Sorted points, one per size value: the least peak (several runs measure each size)."""
    least: Dict[float, float] = {}
    for value, mb in points:
        least[value] = min(mb, least.get(value, mb))
    return sorted(least.items())


def _size_value(size_label: str, key: str) -> Optional[float]:
    for part in size_label.split():
        name, _, value = part.partition("=")
        if name == key:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def fits_table(fits) -> str:
    """The fits search as Markdown; with a timed row (fits.fits_in_time), two more columns:
    its CPU-time ratio to tf.gradients at that size and the budget it used."""
    if not fits:
        return ""
    timed = any(f.time_limit is not None for f in fits)
    extra = " CPU time / tf.gradients there | budget MB |" if timed else ""
    lines = [
        f"| variant | largest {fits[0].axis} under {fits[0].cap_mb:g} MB | measured peak MB "
        f"| vs tf.gradients |{extra} probes ({fits[0].axis}: MB{', CPU time' if timed else ''}) |",
        "|---|---|---|---|" + ("---|---|" if timed else "") + "---|",
    ]
    for f in fits:
        if f.error and f.largest is None:
            largest = f.error[:80]
        else:
            largest = "none" if f.largest is None else str(f.largest) + (" (search limit)" if f.hit_limit else "")
        probes = ", ".join(f"{v}: {_mb(mb)}" + _probe_time(f, v) for v, mb in f.probes)
        peak = "" if f.peak_mb is None else f"{f.peak_mb:.1f}"
        ratio = "" if f.ratio is None else f"{f.ratio:.2f}x"
        cells = ""
        if timed:
            time_ratio = "" if f.time_ratio is None else f"{f.time_ratio:.2f}x"
            budget = "" if f.budget_mb is None else f"{f.budget_mb:.3g}"
            cells = f" {time_ratio} | {budget} |"
        lines.append(f"| {f.variant} | {largest} | {peak} | {ratio} |{cells} {probes} |")
    return "\n".join(lines)


def _probe_time(fit, value) -> str:
    if value not in fit.probe_time_ratios:
        return ""
    ratio = fit.probe_time_ratios[value]
    if ratio is None:
        return " (not timed)"
    builds = fit.probe_build_ratios.get(value)
    each = f" (median of {'/'.join(f'{r:.2f}' for r in builds)})" if builds else ""
    return f" at {ratio:.2f}x{each}"


def _mb(mb) -> str:
    if mb is None:
        return "err"
    return f"{mb:.0f}" if mb >= 10 else f"{mb:.2g}"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_peak_vs_depth(rows, path: str, model: str = "resnet", key: str = "depth") -> Optional[str]:
    """Log-log peak MB vs depth per variant, fitted exponents in the legend."""
    plt = _pyplot()
    data = series(rows, model, key)
    data = {v: p for v, p in data.items() if len({x for x, _ in p}) >= 2}
    if plt is None or not data:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    markers = "osD^vP*Xh"
    styles = ("-", "--", "-.", ":")
    for i, (variant, points) in enumerate(data.items()):
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        b, a = fit_power_law(xs, ys)
        # distinct marker and dash per variant: lines that coincide stay visible
        line, = ax.plot(xs, ys, linestyle=styles[i % len(styles)], marker=markers[i % len(markers)],
                        markersize=7 - 0.4 * i, label=f"{variant}  (exponent {b:.2f})")
        grid = np.geomspace(min(xs), max(xs), 50)
        ax.plot(grid, a * grid ** b, ":", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"{model} {key}")
    ax.set_ylabel("measured peak memory of one training step (MB)")
    batch = next((r.result.batch for r in rows if r.result.model == model), "")
    ax.set_title(f"Peak memory vs {key}: {model}, batch {batch} (fit: MB = a * {key}^b)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_time_overhead(rows, path: str) -> Optional[str]:
    """Grouped bars: step-time ratio to tf.gradients per variant, per model size."""
    plt = _pyplot()
    groups: Dict[str, Dict[str, float]] = {}
    several = len(_runs(rows)) > 1
    for row in rows:
        if row.time_ratio is None or row.result.variant == FRONTIER:
            continue
        res = row.result
        label = f"{res.model}\n{res.size}".replace(" ", "\n", 1) if len(res.size) < 18 else (
            f"{res.model}\n{_short_size(res.size)}")
        if several:
            label += f"\nrun {row.run}"
        groups.setdefault(label, {})[res.variant] = row.time_ratio
    if plt is None or not groups:
        return None
    variants = []
    for g in groups.values():
        for v in g:
            if v not in variants:
                variants.append(v)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.3 * len(groups) + 2), 5))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        xs = [j + i * width for j, g in enumerate(groups.values()) if variant in g]
        ys = [g[variant] for g in groups.values() if variant in g]
        ax.bar(xs, ys, width, label=variant)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels(list(groups), fontsize=7)
    ax.set_ylabel("median step time / tf.gradients")
    ax.set_title("Time overhead (ratios measured in the same run, steps interleaved)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _short_size(size: str) -> str:
    keep = ("depth", "layers", "levels", "n")
    parts = [p for p in size.split() if p.split("=")[0] in keep]
    return " ".join(parts) or size[:16]


def plot_loss_curves(curves, path: str) -> Optional[str]:
    plt = _pyplot()
    if plt is None or curves is None:
        return None
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, 6), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    steps = np.arange(1, len(curves.baseline) + 1)
    ax.plot(steps, curves.baseline, "-", linewidth=3, alpha=0.5, label="tf.gradients")
    ax.plot(steps, curves.checkpointed, "k--", linewidth=1,
            label=f"memory_saving_gradients ('{curves.strategy}')")
    ax.set_ylabel("training loss (before each SGD step)")
    ax.set_title(f"Same training: {curves.steps} SGD steps, lr {curves.learning_rate:g}, dropout off")
    ax.legend()
    ax.grid(alpha=0.3)
    diff = np.abs(np.asarray(curves.checkpointed) - np.asarray(curves.baseline))
    ax2.plot(steps, diff, ".-")
    ax2.set_ylabel("|difference|")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _groups(rows) -> Dict[Tuple[str, str, int], list]:
    """Rows by (model, size, run): the variants measured together."""
    out: Dict[Tuple[str, str, int], list] = {}
    for row in rows:
        out.setdefault((row.result.model, row.result.size, getattr(row, "run", 1)), []).append(row)
    return out


def _label(model: str, size: str) -> str:
    return f"{model} {_short_size(size)}".strip()


def _not_slower(ours: Optional[float], theirs: Optional[float], noise: Optional[float]) -> Optional[bool]:
    """``ours`` at most ``theirs`` within NOISE_MULTIPLE times the noise (None: unmeasured)."""
    if ours is None or theirs is None:
        return None
    return ours <= theirs * (1 + NOISE_MULTIPLE * (noise or 0))


def _both(*oks: Optional[bool]) -> Optional[bool]:
    """All true; None when any is unknown and none is false."""
    if any(ok is False for ok in oks):
        return False
    return None if any(ok is None for ok in oks) else True


def _curve(group) -> list:
    """The frontier's points of a group: the budget points and 'memory', measured."""
    return [r for r in group if r.result.variant in (FRONTIER, "memory")
            and r.peak_ratio is not None and r.cpu_ratio is not None]


def _noises(group) -> Tuple[Optional[float], Optional[float]]:
    """(CPU-time noise, wall-time noise) of a group."""
    cpu = next((r.cpu_noise for r in group if r.cpu_noise is not None), None)
    wall = next((r.noise for r in group if r.noise is not None), None)
    return cpu, wall


def frontier_checks(rows) -> List[Dict[str, object]]:
    """Per model size (and run) with a frontier, per anchor (ANCHORS and tf.gradients):
    the anchor's measured peak and time ratios, and the least time ratio of a frontier
    point (or 'memory') whose measured peak is at most the anchor's (within
    PEAK_JITTER), in CPU time and in wall time.  ``ok``: in both clocks, not slower
    than the anchor by more than NOISE_MULTIPLE times the group's noise of that clock."""
    checks = []
    for (model, size, run), group in _groups(rows).items():
        curve = _curve(group)
        if not any(r.result.variant == FRONTIER for r in curve):
            continue
        cpu_noise, noise = _noises(group)
        for anchor in group:
            if anchor.result.variant not in ANCHORS + ("tf.gradients",) or anchor.cpu_ratio is None:
                continue
            below = [r for r in curve if r.peak_ratio <= anchor.peak_ratio * (1 + PEAK_JITTER)]
            ours = min((r.cpu_ratio for r in below), default=None)
            ours_wall = min((r.time_ratio for r in below if r.time_ratio is not None), default=None)
            ok_cpu = _not_slower(ours, anchor.cpu_ratio, cpu_noise)
            ok_wall = _not_slower(ours_wall, anchor.time_ratio, noise)
            checks.append(dict(model=_label(model, size), run=run, anchor=anchor.result.variant,
                               peak_ratio=anchor.peak_ratio, cpu_ratio=anchor.cpu_ratio,
                               ours=ours, cpu_noise=cpu_noise, time_ratio=anchor.time_ratio,
                               ours_wall=ours_wall, noise=noise, ok_cpu=ok_cpu, ok_wall=ok_wall,
                               ok=None if ours is None else _both(ok_cpu, ok_wall)))
    return checks


def _worst_slowdown(points, clock: str):
    """The pair of points whose larger-peak one is the most slower than the other, in the
    ratio ``clock`` ('cpu_ratio' or 'time_ratio'): (slowdown, faster point, slower point),
    or None.  A point peaks no lower than another within PEAK_JITTER, so that two points
    of the same plan are compared both ways."""
    worst = None
    for low in points:
        for high in points:
            if high is low or high.peak_ratio * (1 + PEAK_JITTER) < low.peak_ratio:
                continue
            t_low, t_high = getattr(low, clock), getattr(high, clock)
            if t_low is None or t_high is None:
                continue
            slowdown = t_high / t_low - 1
            if worst is None or slowdown > worst[0]:
                worst = (slowdown, low, high)
    return worst


def monotone_checks(rows) -> List[Dict[str, object]]:
    """Per model size (and run) with a frontier: the frontier's points and 'memory'
    ordered by measured peak; the worst case of a point that peaks no lower than
    another (within PEAK_JITTER) being slower than it, in CPU and in wall time.
    ``ok``: in both clocks, no such slowdown beyond NOISE_MULTIPLE times the noise."""
    checks = []
    for (model, size, run), group in _groups(rows).items():
        curve = _curve(group)
        if not any(r.result.variant == FRONTIER for r in curve) or len(curve) < 2:
            continue
        cpu_noise, noise = _noises(group)
        found = dict(model=_label(model, size), run=run, points=len(curve),
                     cpu_noise=cpu_noise, noise=noise)
        oks = []
        for clock, prefix, clock_noise in (("cpu_ratio", "cpu", cpu_noise), ("time_ratio", "wall", noise)):
            worst = _worst_slowdown(curve, clock)
            if worst is None:
                found.update({f"{prefix}_worst": None, f"{prefix}_pair": None})
                oks.append(None)
                continue
            slowdown, low, high = worst
            found[f"{prefix}_worst"] = slowdown
            found[f"{prefix}_pair"] = ((low.peak_ratio, getattr(low, clock)),
                                       (high.peak_ratio, getattr(high, clock)))
            oks.append(slowdown <= NOISE_MULTIPLE * (clock_noise or 0))
        found["ok"] = _both(*oks)
        checks.append(found)
    return checks


def recompute_cost_bound(predicted_ratio: float) -> float:
    """The most CPU-time ratio 'memory' may measure for plan()'s ``predicted_ratio``:
    1 + RECOMPUTE_COST_FACTOR x (predicted - 1) + RECOMPUTE_COST_SLACK."""
    return 1 + RECOMPUTE_COST_FACTOR * (predicted_ratio - 1) + RECOMPUTE_COST_SLACK


def recompute_cost_checks(rows) -> List[Dict[str, object]]:
    """Per model size (and run): 'memory''s measured CPU-time ratio against the bound of
    its predicted recomputation (:func:`recompute_cost_bound`)."""
    checks = []
    for row in rows:
        res = row.result
        if res.variant != "memory" or res.predicted_time_ratio is None or row.cpu_ratio is None:
            continue
        bound = recompute_cost_bound(res.predicted_time_ratio)
        checks.append(dict(model=_label(res.model, res.size), run=getattr(row, "run", 1),
                           predicted=res.predicted_time_ratio, cpu_ratio=row.cpu_ratio,
                           time_ratio=row.time_ratio, bound=bound, ok=row.cpu_ratio <= bound))
    return checks


def every_run_summary(rows) -> List[Dict[str, object]]:
    """Per model size and check (each anchor, monotone, 'memory''s cost): whether it
    holds in each run and in every one.  ``runs``: {run: ok}, a run without the check
    is missing from it (and then the check does not hold in every run)."""
    runs = _runs(rows)
    summary: Dict[Tuple[str, str], Dict[int, Optional[bool]]] = {}
    for c in frontier_checks(rows):
        summary.setdefault((c["model"], f"not slower than {c['anchor']}"), {})[c["run"]] = c["ok"]
    for c in monotone_checks(rows):
        summary.setdefault((c["model"], "monotone"), {})[c["run"]] = c["ok"]
    for c in recompute_cost_checks(rows):
        summary.setdefault((c["model"], "'memory' within its predicted recomputation"), {})[c["run"]] = c["ok"]
    return [dict(model=model, check=check, runs=oks,
                 every=all(oks.get(run) is True for run in runs))
            for (model, check), oks in summary.items()]


def least_peak_checks(rows) -> List[Dict[str, object]]:
    """Per model size: 'memory''s measured peak against the least of every other
    checkpointing variant (recompute_grad, collection, speed, budgets, frontier).
    A variant whose plan keeps the same checkpoints (a budget just above
    'memory''s peak) is the same step measured again, not another variant."""
    checks = []
    others_of = ("recompute_grad", "collection", "speed", "memory+budget", FRONTIER)
    for (model, size, run), group in _groups(rows).items():
        ours = next((r for r in group if r.result.variant == "memory" and r.result.ok), None)
        others = [r for r in group if r.result.variant in others_of and r.result.ok
                  and not (ours is not None and r.result.plan_key is not None
                           and r.result.plan_key == ours.result.plan_key)]
        if ours is None or not others:
            continue
        best = min(others, key=lambda r: r.result.peak_bytes)
        ratio = ours.result.peak_bytes / best.result.peak_bytes
        checks.append(dict(model=_label(model, size), run=run, memory_mb=ours.result.peak_bytes / MIB,
                           least_other=best.result.variant, other_mb=best.result.peak_bytes / MIB,
                           ratio=ratio, ok=ratio <= 1 + LEAST_PEAK_SLACK))
    return checks


def time_prediction_checks(rows) -> List[Dict[str, object]]:
    """Per library variant measured with timing: plan()'s predicted step-time ratio against
    the measured CPU-time and wall-time ratios; ``ok``: the prediction is within
    ``TIME_PREDICTION_TOLERANCE`` of the measured CPU-time ratio."""
    checks = []
    for row in rows:
        res = row.result
        if res.predicted_time_ratio is None or row.cpu_ratio is None:
            continue
        error = res.predicted_time_ratio / row.cpu_ratio - 1
        checks.append(dict(model=_label(res.model, res.size), run=getattr(row, "run", 1), variant=res.variant,
                           predicted=res.predicted_time_ratio, cpu_ratio=row.cpu_ratio,
                           time_ratio=row.time_ratio, error=error,
                           ok=abs(error) <= TIME_PREDICTION_TOLERANCE))
    return checks


def time_prediction_table(checks) -> str:
    lines = ["| model | variant | plan() time / tf.gradients | measured CPU time | measured wall "
             f"time | prediction off by | within {100 * TIME_PREDICTION_TOLERANCE:.0f}% |",
             "|---|---|---|---|---|---|---|"]
    for c in checks:
        wall = "" if c["time_ratio"] is None else f"{c['time_ratio']:.2f}x"
        lines.append(f"| {c['model']} | {c['variant']} | {c['predicted']:.2f}x | "
                     f"{c['cpu_ratio']:.2f}x | {wall} | {100 * c['error']:+.0f}% | "
                     f"{'yes' if c['ok'] else 'NO'} |")
    return "\n".join(lines)


def _yes(ok: Optional[bool]) -> str:
    return "" if ok is None else ("yes" if ok else "NO")


def _ratio(value: Optional[float]) -> str:
    return "none" if value is None else f"{value:.2f}x"


def _pct(value: Optional[float]) -> str:
    return "" if value is None else f"{100 * value:.0f}%"


def frontier_table(checks) -> str:
    lines = ["| model | anchor | anchor peak / tf.gradients | anchor CPU time | frontier's least "
             "CPU time at <= that peak | CPU noise | anchor wall time | frontier's least wall "
             "time | wall noise | not slower (CPU) | not slower (wall) | not slower (both) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['model']} | {c['anchor']} | {c['peak_ratio']:.3f} | "
                     f"{_ratio(c['cpu_ratio'])} | {_ratio(c['ours'])} | {_pct(c['cpu_noise'])} | "
                     f"{_ratio(c['time_ratio'])} | {_ratio(c['ours_wall'])} | {_pct(c['noise'])} | "
                     f"{_yes(c.get('ok_cpu'))} | {_yes(c.get('ok_wall'))} | {_yes(c['ok'])} |")
    return "\n".join(lines)


def monotone_table(checks) -> str:
    def pair(found):
        if found is None:
            return ""
        (peak_low, t_low), (peak_high, t_high) = found
        return f"{peak_low:.3f}x peak: {t_low:.2f}x; {peak_high:.3f}x peak: {t_high:.2f}x"

    def slowdown(value):
        return "" if value is None else f"{100 * value:+.1f}%"

    lines = ["| model | points | worst slowdown, CPU | its points | CPU noise | worst slowdown, wall "
             "| its points | wall noise | monotone |", "|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['model']} | {c['points']} | {slowdown(c['cpu_worst'])} | {pair(c['cpu_pair'])} "
                     f"| {_pct(c['cpu_noise'])} | {slowdown(c['wall_worst'])} | {pair(c['wall_pair'])} "
                     f"| {_pct(c['noise'])} | {_yes(c['ok'])} |")
    return "\n".join(lines)


def recompute_cost_table(checks) -> str:
    lines = ["| model | plan() time / tf.gradients | bound (CPU) | measured CPU time | measured wall time "
             "| within |", "|---|---|---|---|---|---|"]
    for c in checks:
        wall = "" if c["time_ratio"] is None else f"{c['time_ratio']:.2f}x"
        lines.append(f"| {c['model']} | {c['predicted']:.2f}x | {c['bound']:.2f}x | {c['cpu_ratio']:.2f}x "
                     f"| {wall} | {_yes(c['ok'])} |")
    return "\n".join(lines)


def every_run_table(summary, runs: Sequence[int]) -> str:
    lines = ["| model | check | " + " | ".join(f"run {r}" for r in runs) + " | holds in every run |",
             "|---|---|" + "---|" * len(runs) + "---|"]
    for s in summary:
        cells = " | ".join("-" if r not in s["runs"] else (_yes(s["runs"][r]) or "?") for r in runs)
        lines.append(f"| {s['model']} | {s['check']} | {cells} | {'yes' if s['every'] else 'NO'} |")
    return "\n".join(lines)


def per_run(checks, table: Callable[[list], str]) -> str:
    """``table`` of the checks; checks of several runs as one table per run, each headed."""
    runs = sorted({c.get("run", 1) for c in checks})
    if len(runs) <= 1:
        return table(checks)
    parts = []
    for run in runs:
        parts += [f"Run {run} of {len(runs)}:", "", table([c for c in checks if c.get("run", 1) == run]), ""]
    return "\n".join(parts).rstrip()


def least_peak_table(checks) -> str:
    lines = ["| model | 'memory' peak MB | least other variant | its peak MB | ratio | "
             f"within {100 * LEAST_PEAK_SLACK:.0f}% |", "|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['model']} | {c['memory_mb']:.1f} | {c['least_other']} | "
                     f"{c['other_mb']:.1f} | {c['ratio']:.3f} | {'yes' if c['ok'] else 'NO'} |")
    return "\n".join(lines)


def _half_spread(row) -> float:
    """Half the interquartile range of a row's CPU time, as a CPU-time ratio: its error bar."""
    spread = getattr(row.result, "cpu_spread", None)
    return 0.0 if spread is None or row.cpu_ratio is None else row.cpu_ratio * spread / 2


def plot_pareto(rows, path: str) -> Optional[str]:
    """Peak ratio against CPU-time ratio, one panel per model size with a frontier (a row of
    panels per run): the budget sweep as a curve (by measured peak), the anchors as
    labelled points, each point with a horizontal bar as wide as the interquartile range
    of its CPU time per step (relative to its median, applied to its ratio)."""
    plt = _pyplot()
    panels = {key: group for key, group in _groups(rows).items()
              if any(r.result.variant == FRONTIER and r.peak_ratio is not None for r in group)}
    if plt is None or not panels:
        return None
    runs = sorted({run for _, _, run in panels})
    sizes = list(dict.fromkeys((model, size) for model, size, _ in panels))
    fig, axes = plt.subplots(len(runs), len(sizes), figsize=(5.5 * len(sizes), 4.8 * len(runs)),
                             squeeze=False)
    markers = {"tf.gradients": "s", "grappler-recompute": "v", "recompute_grad": "^",
               "collection": "D", "speed": "P", "memory": "*", "memory+budget": "X"}
    for (model, size, run), group in panels.items():
        ax = axes[runs.index(run)][sizes.index((model, size))]
        curve = sorted((r for r in group if r.result.variant in (FRONTIER, "memory")
                        and r.cpu_ratio is not None and r.peak_ratio is not None),
                       key=lambda r: r.peak_ratio)
        ax.errorbar([r.cpu_ratio for r in curve], [r.peak_ratio for r in curve],
                    xerr=[_half_spread(r) for r in curve], fmt="k.-", linewidth=1.5, capsize=2,
                    elinewidth=0.8, label="'memory' + memory_budget sweep (by peak)")
        for r in group:
            v = r.result.variant
            if v == FRONTIER or r.cpu_ratio is None or r.peak_ratio is None:
                continue
            ax.errorbar(r.cpu_ratio, r.peak_ratio, xerr=_half_spread(r), fmt=markers.get(v, "o"),
                        markersize=9 if v == "memory" else 7, capsize=2, elinewidth=0.8,
                        label=v, alpha=0.85)
        noise = next((r.cpu_noise for r in group if r.cpu_noise is not None), None)
        title = _label(model, size) + (f", run {run}" if len(runs) > 1 else "") + (
            f" (CPU-time noise {100 * noise:.1f}%)" if noise else "")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("CPU time per step / tf.gradients' (bars: interquartile range)")
        ax.set_ylabel("peak memory / tf.gradients")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.flat:
        if not ax.has_data():
            ax.set_visible(False)
    fig.suptitle("Memory/time frontier: lower left is better; each panel measured in one run",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _optional(value, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def write_fits_csv(fits, path: str) -> None:
    """fits.csv: one line per fit; a timed row (fits.fits_in_time) fills the last five columns."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "cap_mb", "axis", "largest", "peak_mb", "ratio", "probes", "error",
                    "time_limit", "time_ratio", "budget_mb", "probe_time_ratios",
                    "probe_build_ratios"])
        for fit in fits:
            w.writerow([fit.variant, fit.cap_mb, fit.axis, fit.largest or "",
                        _optional(fit.peak_mb), _optional(fit.ratio),
                        ";".join(f"{v}:{_optional(mb)}" for v, mb in fit.probes),
                        fit.error or "", "" if fit.time_limit is None else f"{fit.time_limit:g}",
                        _optional(fit.time_ratio), _optional(fit.budget_mb),
                        ";".join(f"{v}:{_optional(r)}" for v, r in fit.probe_time_ratios.items()),
                        ";".join(f"{v}:" + "/".join(_optional(r) for r in builds)
                                 for v, builds in fit.probe_build_ratios.items())])


def _check_section(title: str, text: str, checks, table: Callable[[list], str]) -> List[str]:
    """A results.md section: its title, what it checks, one table per run; nothing
    without checks."""
    return [f"## {title}", "", text, "", per_run(checks, table), ""] if checks else []


def frontier_sections(rows) -> List[str]:
    """results.md's frontier checks: against the anchors, monotone, 'memory''s cost
    against its prediction; per run, and with several runs whether each holds in every one."""
    tolerance = (f"within {NOISE_MULTIPLE} times the group's noise of that clock (a ratio r "
                 f"counts as not above a ratio a when r <= a x (1 + {NOISE_MULTIPLE} x noise))")
    noise = ("Noise: the median over the variants of the half interquartile range of their step "
             "times, relative to their median, per clock.")
    frontier = frontier_checks(rows)
    monotone = monotone_checks(rows)
    cost = recompute_cost_checks(rows)
    md = _check_section(
        "Frontier against the anchors",
        "At each anchor's measured peak: the least step-time ratio of a frontier point "
        f"(or 'memory') that peaks no higher (within {100 * PEAK_JITTER:g}%), in CPU seconds "
        "of the process per step and in wall seconds. 'not slower': " + tolerance
        + "; both: in CPU and in wall time. " + noise, frontier, frontier_table)
    md += _check_section(
        "The frontier is monotone",
        "The frontier's points and 'memory', ordered by measured peak: the worst case of a "
        f"point that peaks no lower than another (within {100 * PEAK_JITTER:g}%) running "
        "slower than it. Monotone: in CPU and in wall time no such slowdown beyond "
        f"{NOISE_MULTIPLE} times the group's noise of that clock. " + noise,
        monotone, monotone_table)
    md += _check_section(
        "'memory' against its predicted recomputation",
        "'memory''s measured CPU-time ratio against plan()'s predicted step-time ratio p: "
        f"within when measured - 1 <= {RECOMPUTE_COST_FACTOR:g} x (p - 1) + "
        f"{RECOMPUTE_COST_SLACK:g} (the bound column).", cost, recompute_cost_table)
    runs = _runs(rows)
    if len(runs) > 1 and (frontier or monotone or cost):
        md += ["## Holds in every run", "",
               f"Each check above in each of the {len(runs)} runs (every model size rebuilt, "
               "traced and timed again in each).", "", every_run_table(every_run_summary(rows), runs), ""]
    return md


def write_outputs(out_dir: str, rows, fits=None, curves=None, extra_sections=(),
                  header: str = "") -> Dict[str, str]:
    """Write results.csv, results.md and the PNGs; return {kind: path} of what was written."""
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    path = os.path.join(out_dir, "results.csv")
    write_csv(rows, path)
    written["csv"] = path
    if fits:
        path = os.path.join(out_dir, "fits.csv")
        write_fits_csv(fits, path)
        written["fits_csv"] = path
    for kind, fn, name in (
        ("peak_png", lambda p: plot_peak_vs_depth(rows, p), "peak_vs_depth.png"),
        ("time_png", lambda p: plot_time_overhead(rows, p), "time_overhead.png"),
        ("loss_png", lambda p: plot_loss_curves(curves, p), "loss_curves.png"),
        ("pareto_png", lambda p: plot_pareto(rows, p), "pareto.png"),
    ):
        result = fn(os.path.join(out_dir, name))
        if result:
            written[kind] = result
    md = [header] if header else []
    md += ["## Measured peak memory and step time", "", markdown_table(rows), ""]
    exps = exponents(rows)
    if exps:
        md += ["## Peak memory vs ResNet depth: fitted exponent (MB = a * depth^b)", "",
               "| variant | exponent b |", "|---|---|"]
        md += [f"| {v} | {b:.2f} |" for v, b in exps.items()] + [""]
    md += _check_section(
        "'memory' takes the least peak",
        "'memory''s measured peak against the least of every other checkpointing "
        "variant of the same model size (per-unit recompute_grad, 'collection', "
        "'speed', budgets, frontier points).", least_peak_checks(rows), least_peak_table)
    md += _check_section(
        "Predicted against measured step time",
        "plan()'s predicted step-time ratio (the time model, memory_saving_gradients.timing: "
        "the forward, gradient and recomputed seconds of the region's ops) against the "
        "measured ratios of the same run.", time_prediction_checks(rows), time_prediction_table)
    md += frontier_sections(rows)
    if fits:
        md += [f"## Fits in {fits[0].cap_mb:g} MB", "", fits_table(fits), ""]
    if curves is not None:
        md += ["## Training behaviour", "",
               f"{curves.steps} SGD steps of {curves.model} (lr {curves.learning_rate:g}): "
               f"tf.gradients loss {curves.baseline[0]:.4f} -> {curves.baseline[-1]:.4f}; "
               f"'{curves.strategy}' loss {curves.checkpointed[0]:.4f} -> {curves.checkpointed[-1]:.4f}; "
               f"largest relative difference {curves.max_rel_diff:.2e} "
               f"({'same curve' if curves.same else 'CURVES DIFFER'} within {curves.rtol:g}).", ""]
    for title, body in extra_sections:
        md += [f"## {title}", "", body, ""]
    for kind, label in (("peak_png", "Peak vs depth"), ("time_png", "Time overhead"),
                        ("loss_png", "Loss curves"), ("pareto_png", "Memory/time frontier")):
        if kind in written:
            md.append(f"![{label}]({os.path.basename(written[kind])})")
    path = os.path.join(out_dir, "results.md")
    with open(path, "w") as f:
        f.write("\n".join(md).rstrip() + "\n")
    written["md"] = path
    return written

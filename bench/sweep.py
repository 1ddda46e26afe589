"""The sweep: every model size with every variant, ratios to ``tf.gradients``.

For one model size, every variant is prepared (built, traced for its peak,
gradients checked) in its own graph and session; then their steps are
timed in turn (:func:`core.time_interleaved`), so that ratios compare
variants measured in the same process under the same load.

With ``frontier`` points, each model size also gets that many
``checkpoints='memory'`` runs with ``memory_budget`` spaced evenly in ratio
from the least predicted peak ('memory''s own plan) to plain
``tf.gradients``' predicted peak, and one at each anchor's measured peak
(:func:`frontier_budgets`): the memory/time frontier, timed in the
same interleaved rounds as the anchors (variant ``'frontier'``).  Each
group's timing noise (:func:`timing_noise`) is kept on its rows.

With ``repeats`` above 1 the whole sweep runs that many times, every model
size rebuilt, traced and timed again in each; a row's ``run`` (1, 2, ...)
says which, and ratios compare only rows of the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from typing import Callable, List, Optional, Sequence

import memory_saving_gradients as msg

from . import core
from .core import ModelSpec, Result

BASELINE = "tf.gradients"
FRONTIER = "frontier"


@dataclasses.dataclass
class Row:
    """A measured Result with its ratios to the baseline of the same model size."""

    result: Result
    peak_ratio: Optional[float] = None
    time_ratio: Optional[float] = None
    cpu_ratio: Optional[float] = None  # of CPU seconds per step (all threads of the process)
    noise: Optional[float] = None  # the group's wall-time noise (see timing_noise)
    cpu_noise: Optional[float] = None  # the same for CPU time
    run: int = 1  # which repeat of the sweep measured it (1, 2, ...)

    def __getattr__(self, name):  # the Result's fields read through
        return getattr(self.result, name)


def run_sweep(
    specs: Sequence[ModelSpec],
    variants: Sequence[str],
    steps: int = 5,
    budget_fraction: float = core.DEFAULT_BUDGET_FRACTION,
    device: str = "",
    progress: bool = True,
    on_row: Optional[Callable[[Row], None]] = None,
    frontier: int = 0,
    repeats: int = 1,
) -> List[Row]:
    """Measure every spec with every variant, ``repeats`` times over; rows in run, spec,
    then variant order (then the ``frontier`` budget points, from the least peak up)."""
    repeats = max(1, int(repeats))
    bar = _progress(repeats * len(specs) * (len(variants) + frontier), progress)
    rows: List[Row] = []
    try:
        for run in range(1, repeats + 1):
            for spec in specs:
                group = _measure_group(spec, variants, steps, budget_fraction, device, frontier, bar,
                                       run if repeats > 1 else None)
                for row in group:
                    row.run = run
                rows.extend(group)
                if on_row:
                    for row in group:
                        on_row(row)
    finally:
        bar.close()
    return rows


def _measure_group(spec, variants, steps, budget_fraction, device, frontier, bar, run) -> List[Row]:
    """One model size: every variant (and frontier point) prepared, then timed interleaved."""
    label = f"{spec.name} {spec.size_label}" + ("" if run is None else f" run {run}")
    prepared = []
    for variant in variants:
        bar.set_description(f"{label} {variant}"[:60])
        prepared.append(core.prepare(spec, variant, budget_fraction=budget_fraction,
                                     device=device))
        bar.update(1)
    for budget in frontier_budgets(prepared, frontier):
        bar.set_description(f"{label} frontier"[:60])
        with warnings.catch_warnings():
            # the frontier's last budget is plain's predicted peak, where the planner
            # keeps nothing by design: its row (plain's peak and time) says so
            warnings.simplefilter("ignore", msg.NothingKeptWarning)
            point = core.prepare(spec, "memory+budget", budget_bytes=budget, device=device)
        point.result.variant = FRONTIER
        prepared.append(point)
        bar.update(1)
    try:
        bar.set_description(f"{label} timing"[:60])
        core.time_interleaved(prepared, steps)
        noise = timing_noise([p.times for p in prepared])
        cpu_noise = timing_noise([p.cpu_times for p in prepared])
    finally:
        for p in prepared:
            p.close()
    group = [Row(p.result, noise=noise, cpu_noise=cpu_noise) for p in prepared]
    add_ratios(group)
    return group


def add_ratios(group: Sequence[Row]) -> None:
    """Peak and time ratios to the baseline row of the same group (measured together)."""
    base = next((r for r in group if r.result.variant == BASELINE and r.result.ok), None)
    if base is None:
        return
    for row in group:
        res = row.result
        if not res.ok:
            continue
        if base.result.peak_bytes:
            row.peak_ratio = res.peak_bytes / base.result.peak_bytes
        if res.median_step_seconds is not None and base.result.median_step_seconds:
            row.time_ratio = res.median_step_seconds / base.result.median_step_seconds
        if res.median_step_cpu_seconds and base.result.median_step_cpu_seconds:
            row.cpu_ratio = res.median_step_cpu_seconds / base.result.median_step_cpu_seconds


#: Anchors whose measured peak also gets a frontier point budgeted at it.
ANCHORED = ("recompute_grad", "grappler-recompute", "collection", "speed")


def frontier_budgets(prepared, points: int) -> List[int]:
    """``points`` budgets from the least predicted peak to the baseline's, even in ratio,
    and one at each anchor's measured peak (:data:`ANCHORED`) between them.

    The least peak is the 'memory' variant's prediction (planned here when the
    sweep did not run that variant); the first budget is 1% above it, so that
    rounding does not make it infeasible.  A budget at an anchor's measured peak
    asks for the plan that recomputes least within it, which the frontier is
    compared with at that peak.  Budgets within 1% of another are dropped.
    """
    if points <= 0:
        return []
    least = base = None
    anchored = []
    for p in prepared:
        res = p.result
        if res.variant == "memory" and res.predicted_peak_bytes:
            least = res.predicted_peak_bytes
        if res.baseline_predicted_bytes:
            base = res.baseline_predicted_bytes
        if res.variant in ANCHORED and res.ok and res.peak_bytes:
            anchored.append(res.peak_bytes)
    if least is None or base is None:
        return []
    least *= 1.01
    if points == 1 or base <= least:
        even = [int(least)]
    else:
        even = [int(least * (base / least) ** (k / (points - 1))) for k in range(points)]
    budgets: List[int] = []
    for budget in sorted(even + [int(b) for b in anchored if least < b < base]):
        if not budgets or budget > budgets[-1] * 1.01:
            budgets.append(budget)
    return budgets


def timing_noise(times: Sequence[Sequence[float]]) -> Optional[float]:
    """The run's timing noise: the median over variants of the half interquartile
    range of a variant's step times, relative to its median.  Two time ratios
    closer than about twice this are not told apart."""
    spreads = []
    for series in times:
        if len(series) >= 4:
            q = statistics.quantiles(series, n=4)
            spreads.append((q[2] - q[0]) / 2 / statistics.median(series))
    return statistics.median(spreads) if spreads else None


class _NoBar:
    def update(self, n=1):
        pass

    def set_description(self, text):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a bench extra; run without a bar
        return _NoBar()
    return tqdm(total=total, unit="variant", dynamic_ncols=True)

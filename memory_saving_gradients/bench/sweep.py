"""The sweep: every model size with every variant, ratios to ``tf.gradients``.

For one model size, every variant is prepared (built, traced for its peak,
gradients checked) in its own graph and session; then their steps are
timed in turn (:func:`core.time_interleaved`), so that ratios compare
variants measured in the same process under the same load.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence

from . import core
from .core import ModelSpec, Result

BASELINE = "tf.gradients"


@dataclasses.dataclass
class Row:
    """A measured Result with its ratios to the baseline of the same model size."""

    result: Result
    peak_ratio: Optional[float] = None
    time_ratio: Optional[float] = None

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
) -> List[Row]:
    """Measure every spec with every variant; rows in spec, then variant order."""
    bar = _progress(len(specs) * len(variants), progress)
    rows: List[Row] = []
    try:
        for spec in specs:
            prepared = []
            for variant in variants:
                bar.set_description(f"{spec.name} {spec.size_label} {variant}"[:60])
                prepared.append(core.prepare(spec, variant, budget_fraction=budget_fraction,
                                             device=device))
                bar.update(1)
            try:
                bar.set_description(f"{spec.name} {spec.size_label} timing"[:60])
                core.time_interleaved(prepared, steps)
            finally:
                for p in prepared:
                    p.close()
            group = [Row(p.result) for p in prepared]
            add_ratios(group)
            rows.extend(group)
            if on_row:
                for row in group:
                    on_row(row)
    finally:
        bar.close()
    return rows


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

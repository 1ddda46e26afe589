""""Fits in N MB": the largest model each variant trains under a memory cap.

For a cap in MB, search over an integer size parameter (ResNet depth 6k+2,
or the batch) for the largest value whose *measured* peak (one traced step,
:func:`core.prepare`) stays under the cap.  The search starts from a guess
(a power law fitted to the sweep's peaks, when there are any), gallops out
to bracket the answer, then bisects; every probe is a measurement.

With a time limit (``python -m bench --fits-time-limit 1.25``, the
default), one more row: the largest ResNet depth that fits the cap with its
step at most that many times plain ``tf.gradients``' CPU time per step at
the same depth (:func:`fits_in_time`).  Each depth gets a budget chosen for the cap:
``'memory'`` with ``memory_budget`` = the cap, then moved by the measured
gap between the traced peak and the cap (down when above it, up when more
than ``BUDGET_SLACK`` below) and built again, at most ``BUDGET_RETRIES``
times; the build that fits with the largest budget is timed interleaved
with ``tf.gradients`` (``TIME_STEPS`` steps after one warm-up) and the
depth accepted when its CPU-time ratio is within the limit.  A ratio within
``NEAR_LIMIT`` of the limit is measured again on ``BUILDS_NEAR_LIMIT - 1`` fresh
builds of the same budget (each timed against a fresh plain step), and the
median of the builds decides: the same plan's ratio moves more between builds
(ResNet-110 at 49 MB: 1.14-1.26x in seven processes) than between rounds of one
build (about 3%).  The same gallop
and bisection find the largest accepted depth (the ratio grows with depth at a fixed cap,
as the budget leaves less of the activations kept).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from memory_saving_gradients._units import MIB

from . import core

#: The headline's limit: the step at most this many times plain tf.gradients' CPU time.
DEFAULT_TIME_LIMIT = 1.25
#: Times a depth's budget is moved by the measured gap to the cap (and the step built again).
BUDGET_RETRIES = 2
#: A measured peak this close under the cap (a fraction of it) leaves the budget as it is.
BUDGET_SLACK = 0.02
#: Timed steps (after one warm-up) of a depth's budgeted step and plain tf.gradients, interleaved
#: (the default of fits_in_time; ``python -m bench`` uses its ``--steps``).
TIME_STEPS = 5
#: A ratio this close to the limit (either side) is measured on more builds (see the module doc).
NEAR_LIMIT = 0.03
#: Builds whose median ratio decides a depth near the limit (the first one included).
BUILDS_NEAR_LIMIT = 3
#: The row's variant name in the fits table and fits.csv.
TIMED_VARIANT = "memory, budget chosen for the cap"


@dataclasses.dataclass
class Axis:
    """The size parameter searched: value(k) for k = 1, 2, ...; spec(value) builds it."""

    name: str
    value: Callable[[int], int]
    index: Callable[[float], float]  # inverse of value, for guesses
    k_max: int


def resnet_depth_axis(k_max: int = 60) -> Axis:
    return Axis("depth", lambda k: 6 * k + 2, lambda v: (v - 2) / 6.0, k_max)


def batch_axis(k_max: int = 4096, step: int = 1) -> Axis:
    """Batch ``step * k``."""
    return Axis("batch", lambda k: step * k, lambda v: v / step, k_max)


@dataclasses.dataclass
class Fit:
    """The search's answer for one variant."""

    variant: str
    cap_mb: float
    axis: str
    largest: Optional[int]           # None: even the smallest size does not fit
    peak_mb: Optional[float]         # measured at ``largest``
    probes: List[Tuple[int, Optional[float]]]  # (value, measured MB or None on error)
    hit_limit: bool = False          # the largest size searched still fits
    ratio: Optional[float] = None    # largest / tf.gradients' largest
    error: Optional[str] = None
    time_limit: Optional[float] = None  # the step-time bound of a fits_in_time row
    time_ratio: Optional[float] = None  # its measured CPU-time ratio to tf.gradients at ``largest``
    budget_mb: Optional[float] = None   # the memory_budget that fitted at ``largest``
    probe_time_ratios: Dict[int, Optional[float]] = dataclasses.field(default_factory=dict)
    # each build's ratio where a probe near the limit was timed on several (see fits_in_time)
    probe_build_ratios: Dict[int, Tuple[float, ...]] = dataclasses.field(default_factory=dict)


def largest_under_cap(
    peak_of: Callable[[int], Optional[float]], cap: float, k_guess: int, k_max: int
) -> Tuple[Optional[int], bool]:
    """Largest k in [1, k_max] with ``peak_of(k) <= cap`` (peaks rising with k).

    Gallops from ``k_guess`` (1, 2, 4, ... steps) until the answer is
    bracketed, then bisects.  ``peak_of`` returning None counts as not
    fitting.  Returns (k or None, whether k_max itself fits).
    """

    def fits(k):
        peak = peak_of(k)
        return peak is not None and peak <= cap

    return largest_where(fits, k_guess, k_max)


def largest_where(
    accept: Callable[[int], bool], k_guess: int, k_max: int
) -> Tuple[Optional[int], bool]:
    """Largest k in [1, k_max] that ``accept`` s (acceptance falling with k): the gallop
    and bisection of :func:`largest_under_cap`, each k asked at most once."""
    cache: Dict[int, bool] = {}

    def fits(k):
        if k not in cache:
            cache[k] = bool(accept(k))
        return cache[k]

    k = min(max(1, int(k_guess)), k_max)
    if fits(k):
        lo, hi, step = k, None, 1
        while hi is None:
            nxt = lo + step
            if nxt > k_max:
                if lo == k_max or fits(k_max):
                    return k_max, True
                hi = k_max
            elif fits(nxt):
                lo, step = nxt, step * 2
            else:
                hi = nxt
    else:
        hi, lo, step = k, None, 1
        while lo is None:
            nxt = hi - step
            if nxt < 1:
                if hi == 1 or not fits(1):
                    return None, False
                lo = 1
            elif fits(nxt):
                lo = nxt
            else:
                hi, step = nxt, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, False


def guess_index(points: Sequence[Tuple[float, float]], cap_mb: float, axis: Axis) -> int:
    """k whose value a power law through ``(value, MB)`` points puts at the cap."""
    pts = [(v, p) for v, p in points if v > 0 and p and p > 0]
    if len(pts) >= 2:
        from .report import fit_power_law

        exponent, scale = fit_power_law([v for v, _ in pts], [p for _, p in pts])
        if exponent > 0 and scale > 0:
            value = (cap_mb / scale) ** (1.0 / exponent)
            return max(1, int(math.floor(axis.index(value))))
    if len(pts) == 1:
        v, p = pts[0]
        return max(1, int(math.floor(axis.index(v * cap_mb / p))))
    return 1


def fits_in(
    cap_mb: float,
    variants: Sequence[str],
    spec_for: Callable[[int], core.ModelSpec],
    axis: Axis,
    known: Optional[Dict[str, Sequence[Tuple[float, float]]]] = None,
    device: str = "",
    budget_fraction: float = core.DEFAULT_BUDGET_FRACTION,
    on_probe: Optional[Callable[[str, int, Optional[float]], None]] = None,
) -> List[Fit]:
    """For each variant, the largest ``axis`` value whose measured peak fits ``cap_mb``.

    ``spec_for(value)`` builds the model spec at that size; ``known`` maps a
    variant to (value, MB) points already measured (guesses only: every
    answer is measured again here).
    """
    fits: List[Fit] = []
    for variant in variants:
        probes: List[Tuple[int, Optional[float]]] = []
        errors: List[str] = []

        def peak_of(k, variant=variant, probes=probes, errors=errors):
            value = axis.value(k)
            # 'memory+budget' is given the cap itself as its budget: how a user fits a model
            prepared = core.prepare(spec_for(value), variant, check_grads=False, device=device,
                                    budget_fraction=budget_fraction, predict=False,
                                    budget_bytes=int(cap_mb * MIB))
            prepared.close()
            res = prepared.result
            mb = res.peak_bytes / MIB if res.ok else None
            if res.error:
                errors.append(res.error)
            probes.append((value, mb))
            if on_probe:
                on_probe(variant, value, mb)
            return mb

        why_not = core.library_available(variant)
        if why_not:
            fits.append(Fit(variant, cap_mb, axis.name, None, None, [], error="skipped: " + why_not))
            continue
        k_guess = guess_index((known or {}).get(variant, ()), cap_mb, axis)
        k, at_limit = largest_under_cap(peak_of, cap_mb, k_guess, axis.k_max)
        largest = axis.value(k) if k is not None else None
        peak = next((mb for v, mb in probes if v == largest), None)
        error = None
        if k is None and errors:
            error = errors[-1]
        fits.append(Fit(variant, cap_mb, axis.name, largest, peak, sorted(probes),
                        hit_limit=at_limit, error=error))
    add_ratios(fits)
    return fits


def add_ratios(fits: Sequence[Fit]) -> None:
    """Each fit's largest size over tf.gradients' largest (when both are known)."""
    base = next((f for f in fits if f.variant == "tf.gradients" and f.largest), None)
    if base is not None:
        for f in fits:
            if f.largest:
                f.ratio = f.largest / base.largest


class Candidate(Protocol):
    """One size's budgeted step, built and its peak measured; timed when asked."""

    peak_mb: Optional[float]  # None: it did not build or run (``error`` says why)
    error: Optional[str]

    def time_ratio(self) -> Optional[float]:
        """Its CPU time per step over plain tf.gradients' at the same size."""

    def close(self) -> None:
        """Release its session."""


@dataclasses.dataclass
class TimedProbe:
    """One size of the timed search: the last budget tried and what it measured."""

    value: int
    budget_mb: float
    peak_mb: Optional[float]
    time_ratio: Optional[float] = None  # measured only when the peak fits; the median of builds
    error: Optional[str] = None
    build_ratios: Tuple[float, ...] = ()  # each timed build's ratio, when more than one was timed

    def accepted(self, cap_mb: float, time_limit: float) -> bool:
        return (self.peak_mb is not None and self.peak_mb <= cap_mb
                and self.time_ratio is not None and self.time_ratio <= time_limit)


def probe_with_budget(value: int, build: Callable[[int], Candidate], cap_mb: float,
                      retries: int = BUDGET_RETRIES, time_limit: Optional[float] = None,
                      builds_near_limit: int = BUILDS_NEAR_LIMIT) -> TimedProbe:
    """Fit a budget to the cap: build ``build(budget_bytes)`` with the cap as its budget;
    move the budget by the measured gap to the cap (down when the peak is above it, up
    when it is more than BUDGET_SLACK below) and build again, ``retries`` times at most;
    time the build that fits with the largest budget (the least recomputation).  Where
    its ratio lies within NEAR_LIMIT of ``time_limit``, time ``builds_near_limit - 1``
    more builds of that budget and keep the median (:func:`_median_of_builds`)."""
    budget = int(cap_mb * MIB)
    last = TimedProbe(value, budget / MIB, None)
    best: Optional[Tuple[int, Candidate]] = None
    try:
        for _ in range(retries + 1):
            candidate = build(budget)
            last = TimedProbe(value, budget / MIB, candidate.peak_mb, error=candidate.error)
            fitted = candidate.peak_mb is not None and candidate.peak_mb <= cap_mb
            if fitted and (best is None or budget > best[0]):
                if best is not None:
                    best[1].close()
                best = (budget, candidate)
            else:
                candidate.close()
            if candidate.peak_mb is None:
                break
            gap = cap_mb - candidate.peak_mb
            if 0 <= gap <= BUDGET_SLACK * cap_mb:
                break
            budget += int(gap * MIB)
            if budget <= 0:
                break
        if best is None:
            return last
        budget, candidate = best
        ratio = candidate.time_ratio()
        probe = TimedProbe(value, budget / MIB, candidate.peak_mb, time_ratio=ratio)
        if (time_limit is not None and ratio is not None and builds_near_limit > 1
                and abs(ratio - time_limit) <= NEAR_LIMIT):
            candidate.close()
            best = None
            probe = _median_of_builds(probe, ratio, lambda: build(budget), builds_near_limit - 1)
        return probe
    finally:
        if best is not None:
            best[1].close()


def _median_of_builds(probe: TimedProbe, first: float, build: Callable[[], Candidate],
                      more: int) -> TimedProbe:
    """``probe`` with its ratio the median of ``first`` and ``more`` fresh builds' ratios
    (a build that does not run adds none)."""
    ratios = [first]
    for _ in range(more):
        candidate = build()
        try:
            if candidate.peak_mb is not None:
                ratio = candidate.time_ratio()
                if ratio is not None:
                    ratios.append(ratio)
        finally:
            candidate.close()
    return dataclasses.replace(probe, time_ratio=statistics.median(ratios),
                               build_ratios=tuple(ratios))


class _BudgetedStep:
    """The real :class:`Candidate`: 'memory+budget' prepared at one size (core.prepare)."""

    def __init__(self, spec: core.ModelSpec, budget_bytes: int, device: str, steps: int = TIME_STEPS):
        self._spec, self._device, self._steps = spec, device, steps
        self._point = core.prepare(spec, "memory+budget", check_grads=False, device=device,
                                   predict=False, budget_bytes=budget_bytes)
        res = self._point.result
        self.peak_mb = res.peak_bytes / MIB if res.ok else None
        self.error = res.error

    def time_ratio(self) -> Optional[float]:
        plain = core.prepare(self._spec, "tf.gradients", check_grads=False, device=self._device,
                             predict=False)
        try:
            core.time_interleaved([plain, self._point], self._steps)
        finally:
            plain.close()
        ours = self._point.result.median_step_cpu_seconds
        theirs = plain.result.median_step_cpu_seconds
        return ours / theirs if ours and theirs else None

    def close(self) -> None:
        self._point.close()


def fits_in_time(
    cap_mb: float,
    time_limit: float,
    spec_for: Callable[[int], core.ModelSpec],
    axis: Axis,
    k_guess: int = 1,
    device: str = "",
    on_probe: Optional[Callable[[TimedProbe], None]] = None,
    build: Optional[Callable[[int, int], Candidate]] = None,
    steps: int = TIME_STEPS,
) -> Fit:
    """The largest ``axis`` value whose step, with a budget chosen for the cap
    (:func:`probe_with_budget`), fits ``cap_mb`` at most ``time_limit`` times plain
    tf.gradients' CPU time per step.  ``build(value, budget_bytes)`` makes a
    :class:`Candidate` (default: 'memory+budget' of ``spec_for(value)``, timed over
    ``steps`` steps)."""
    if build is None:
        def build(value, budget_bytes):
            return _BudgetedStep(spec_for(value), budget_bytes, device, steps)

    name = f"{TIMED_VARIANT}, step <= {time_limit:g}x tf.gradients"
    why_not = core.library_available("memory+budget")
    if why_not:
        return Fit(name, cap_mb, axis.name, None, None, [], error="skipped: " + why_not,
                   time_limit=time_limit)
    probes: Dict[int, TimedProbe] = {}

    def accept(k):
        value = axis.value(k)
        probe = probe_with_budget(value, lambda budget: build(value, budget), cap_mb,
                                  time_limit=time_limit)
        probes[value] = probe
        if on_probe:
            on_probe(probe)
        return probe.accepted(cap_mb, time_limit)

    k, at_limit = largest_where(accept, k_guess, axis.k_max)
    largest = axis.value(k) if k is not None else None
    best = probes.get(largest)
    errors = [p.error for p in probes.values() if p.error]
    return Fit(name, cap_mb, axis.name, largest, best.peak_mb if best else None,
               sorted((v, p.peak_mb) for v, p in probes.items()), hit_limit=at_limit,
               error=errors[-1] if k is None and errors else None, time_limit=time_limit,
               time_ratio=best.time_ratio if best else None,
               budget_mb=best.budget_mb if best else None,
               probe_time_ratios={v: p.time_ratio for v, p in sorted(probes.items())},
               probe_build_ratios={v: p.build_ratios for v, p in sorted(probes.items())
                                   if p.build_ratios})


def time_guess_index(fits: Sequence[Fit], axis: Axis) -> int:
    """Where the timed search starts: between tf.gradients' and 'memory''s largest sizes
    (their geometric mean), or either one alone."""
    found = [f.largest for f in fits if f.variant in ("tf.gradients", "memory") and f.largest]
    if not found:
        return 1
    value = math.exp(sum(math.log(v) for v in found) / len(found))
    return max(1, int(round(axis.index(value))))

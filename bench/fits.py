""""Fits in N MB": the largest model each variant trains under a memory cap.

For a cap in MB, search over an integer size parameter (ResNet depth 6k+2,
or the batch) for the largest value whose *measured* peak (one traced step,
:func:`core.prepare`) stays under the cap.  The search starts from a guess
(a power law fitted to the sweep's peaks, when there are any), gallops out
to bracket the answer, then bisects; every probe is a measurement.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from memory_saving_gradients._units import MIB

from . import core


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


def largest_under_cap(
    peak_of: Callable[[int], Optional[float]], cap: float, k_guess: int, k_max: int
) -> Tuple[Optional[int], bool]:
    """Largest k in [1, k_max] with ``peak_of(k) <= cap`` (peaks rising with k).

    Gallops from ``k_guess`` (1, 2, 4, ... steps) until the answer is
    bracketed, then bisects.  ``peak_of`` returning None counts as not
    fitting.  Returns (k or None, whether k_max itself fits).
    """
    cache: Dict[int, bool] = {}

    def fits(k):
        if k not in cache:
            peak = peak_of(k)
            cache[k] = peak is not None and peak <= cap
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
    base = next((f for f in fits if f.variant == "tf.gradients" and f.largest), None)
    if base is not None:
        for f in fits:
            if f.largest:
                f.ratio = f.largest / base.largest
    return fits

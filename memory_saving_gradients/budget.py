"""Choosing cuts under a memory budget: dynamic programming along the cuts.

Layer: foundation (pure numbers, no TensorFlow); imports nothing of the library.

The forward pass is cut at some of the candidate cuts of :func:`cuts.live_cuts`;
what lies between two chosen cuts is a segment.  When the backward pass
reaches a segment, memory holds the tensors of every chosen cut before it
(``kept``), plus what recomputing and differentiating the segment allocates
(``segment_bytes``: the outputs of its copies that run, and gradients of
the size of its largest tensor).  A segment costs the time model's seconds
(``simulate.Sizer.cost``, :mod:`.timing`) of its copies that run: a one-op segment whose
gradient reads none of its outputs is differentiated in place, for free.

:func:`least_recompute` finds the chosen cuts with the least recomputation
whose every segment fits ``budget`` (in the spirit of Chen et al. 2016 and
of optimal chain schedules, e.g. Rotor); ``kept`` is a dimension of the
table, quantised into ``levels`` steps, rounding up so that the model never
under-counts.  :func:`smallest_budget` searches the least budget that is
feasible.  Pure functions of numbers: no TensorFlow here.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class CutNumbers(Protocol):
    """What :class:`CutProblem` reads of ``cuts.Cuts`` (by attribute, so that this
    module needs nothing of the graph layer)."""

    @property
    def positions(self) -> Sequence[int]: ...
    @property
    def new_bytes(self) -> Sequence[Sequence[tuple[int, float]]]: ...
    @property
    def output_bytes(self) -> Sequence[float]: ...
    @property
    def held_bytes(self) -> Sequence[float]: ...
    @property
    def work(self) -> Sequence[float]: ...
    @property
    def largest(self) -> Sequence[float]: ...
    @property
    def pruned(self) -> Sequence[Sequence[tuple[int, float, float, float]]]: ...


def _suffix_sums(values: np.ndarray) -> np.ndarray:
    """``out[k]`` = sum of ``values[k:]``; one longer than ``values``."""
    return np.concatenate([np.cumsum(values[::-1])[::-1], [0.0]])


def _pruned_columns(entries, held_only: bool) -> tuple:
    """Positions, work and bytes (held bytes if ``held_only``) of ``(position, work,
    bytes, held bytes)`` entries (``cuts.PrunedOp``), as arrays."""
    where, work, size = [], [], []
    for position, op_work, nbytes, held in entries:
        where.append(position)
        work.append(op_work)
        size.append(held if held_only else nbytes)
    return np.array(where, dtype=np.int64), np.array(work, dtype=float), np.array(size, dtype=float)


class CutProblem:
    """The numbers the dynamic program needs, built once from ``cuts.Cuts``.

    Candidate 0 is the start of the pass (nothing kept), candidate ``n + 1``
    its end; 1..n are the cuts.  Everything is a numpy array, so that one
    step of the program handles all predecessors of a cut at once.
    ``held_only``: a segment's bytes count only the outputs some gradient
    reads, not those freed during the recomputation itself.  The full count
    over-states a segment (most on graphs with many transient tensors, like
    attention), the held count under-states it; neither is exact, and each
    proposes different plans.
    """

    def __init__(self, cuts: CutNumbers, fixed_bytes: int = 0, held_only: bool = False):
        last = len(cuts.output_bytes) - 1
        self.positions = np.array([-1] + list(cuts.positions) + [last], dtype=np.int64)
        # prefix sums shifted by one, so that index p + 1 covers positions <= p
        outputs = cuts.held_bytes if held_only else cuts.output_bytes
        self.output_bytes = np.concatenate([[0.0], np.asarray(outputs, float)])
        self.work_prefix = np.concatenate([[0.0], np.asarray(cuts.work, float)])
        self.fixed_bytes = float(fixed_bytes)
        self.starts = [np.zeros(0)] + [
            np.array([s for s, _ in nb], dtype=np.int64) for nb in cuts.new_bytes
        ] + [np.zeros(0)]
        self.suffix = [np.zeros(1)]
        for nb in cuts.new_bytes:
            self.suffix.append(_suffix_sums(np.array([size for _, size in nb], dtype=float)))
        self.suffix.append(np.zeros(1))
        self.largest = np.asarray(cuts.largest, dtype=float)
        # ops a segment ending at a cut never runs (see cuts.Cuts.pruned): their
        # positions, and suffix sums of their work and bytes
        none = (np.zeros(0, dtype=np.int64), np.zeros(1), np.zeros(1))
        self.pruned = [none]
        for entries in cuts.pruned:
            where, work, size = _pruned_columns(entries, held_only)
            self.pruned.append((where, _suffix_sums(work), _suffix_sums(size)))
        self.pruned.append(none)
        # all the bytes pruned from the segments ending at each candidate: what a
        # segment's bytes may fall below its outputs' (see first_within)
        self.pruned_bytes = np.array([sizes[0] for _, _, sizes in self.pruned])
        self._rows: dict = {}

    def __len__(self):
        return len(self.positions)

    def row(self, b: int) -> tuple:
        """``(segment_bytes, new_kept, cost)`` for every predecessor ``a < b`` of ``b``.

        Computed once per ``b`` and reused: the dynamic programs run several times
        over the same problem with different budgets.
        """
        cached = self._rows.get(b)
        if cached is None:
            preds = np.arange(b)
            cached = (self.segment_bytes(preds, b), self.new_kept(preds, b), self.cost(preds, b))
            self._rows[b] = cached
        return cached

    def segment_bytes(self, a: np.ndarray, b: int) -> np.ndarray:
        """Bytes allocated while segments (a, b] are recomputed and differentiated."""
        pa, pb = self.positions[a], self.positions[b]
        outputs = self.output_bytes[pb + 1] - self.output_bytes[pa + 1] - self._pruned(a, b, 2)
        # largest output in (pa, pb]: a suffix maximum, since pb is the same for all a
        start = int(pa.min()) + 1
        suffix = np.maximum.accumulate(self.largest[start: pb + 1][::-1])[::-1]
        return outputs + 2 * suffix[pa + 1 - start] + self.fixed_bytes

    def new_kept(self, a: np.ndarray, b: int) -> np.ndarray:
        """Bytes of cut b not already kept by cuts a (live ranges are intervals)."""
        k = np.searchsorted(self.starts[b], self.positions[a], side="right")
        return self.suffix[b][k]

    def cost(self, a: np.ndarray, b: int) -> np.ndarray:
        pa, pb = self.positions[a], self.positions[b]
        # a one-op segment whose gradient reads none of its outputs is differentiated
        # in place: its op is among the pruned ones, so it costs nothing here
        return self.work_prefix[pb + 1] - self.work_prefix[pa + 1] - self._pruned(a, b, 1)

    def _pruned(self, a: np.ndarray, b: int, column: int) -> np.ndarray:
        """Work (column 1) or bytes (2) of the ops in segments (a, b] that never run."""
        where = self.pruned[b][0]
        return self.pruned[b][column][np.searchsorted(where, self.positions[a], side="right")]

    def first_within(self, limit: float) -> np.ndarray:
        """For every candidate b, the first candidate a whose segment (a, b] allocates
        less than ``limit``: its outputs, less every byte pruned from segments ending at b,
        are a lower bound on ``segment_bytes``."""
        need = self.output_bytes[self.positions + 1] - self.pruned_bytes - (limit - self.fixed_bytes)
        # output_bytes[pa + 1] must exceed need
        p = np.searchsorted(self.output_bytes, need, side="right") - 1
        return np.searchsorted(self.positions, p - 1, side="left")


def _level_table(rows: int, levels: int) -> tuple:
    """A table of ``rows`` x (levels + 1) states, inf, and a view that reads it shifted.

    ``table[i]`` is row i; ``shifted[i, levels + 1 - s]`` is row i moved s levels
    up (``shifted[i, levels + 1 - s][k] == table[i, k - s]``, inf where k < s),
    for 0 <= s <= levels + 1.  One fancy index of ``shifted`` gathers, for many
    predecessors at once, the states that reach each level: what the programs
    below do at every cut.
    """
    width = levels + 1
    padded = np.full((rows, 2 * width), np.inf)
    return padded[:, width:], sliding_window_view(padded, width, axis=1)


#: Steps of ``kept`` in the programs' tables unless told otherwise.
DEFAULT_LEVELS = 120


def least_recompute(problem: CutProblem, budget: float,
                    levels: int = DEFAULT_LEVELS) -> tuple[list[int], float] | None:
    """Indices of the chosen cuts (1..n) with least recomputation within ``budget``.

    Returns ``(cuts, recompute_work)``, or None when no choice fits.
    """
    n = len(problem)
    if budget <= problem.fixed_bytes:
        return None
    quantum = budget / levels
    width = levels + 1
    best, shifted = _level_table(n, levels)
    best[0, 0] = 0.0
    from_cut = np.full((n, width), -1, dtype=np.int64)
    from_level = np.full((n, width), -1, dtype=np.int64)
    level_index = np.arange(width)
    first = problem.first_within(budget)
    for b in range(1, n):
        lo = max(int(first[b]), 0)
        if lo >= b:
            continue
        all_bytes, all_kept, all_cost = problem.row(b)
        preds = np.flatnonzero(all_bytes[lo:] < budget) + lo
        if preds.size == 0:
            continue
        # the level reached at a, plus the segment, must fit: k - shift <= room
        room = np.floor((budget - all_bytes[preds]) / quantum)
        if b == n - 1:
            shift = np.zeros(preds.shape, dtype=np.int64)
        else:
            shift = np.minimum(np.ceil(all_kept[preds] / quantum), width).astype(np.int64)
        # values[a, k]: reach level k at b from level k - shift[a] at a
        values = shifted[preds, width - shift] + all_cost[preds][:, None]
        values[level_index[None, :] > (room + shift)[:, None]] = np.inf
        choice = values.argmin(axis=0)
        best[b] = values[choice, level_index]
        from_cut[b] = preds[choice]
        from_level[b] = level_index - shift[choice]
    if not np.isfinite(best[n - 1]).any():
        return None
    level = int(np.argmin(best[n - 1]))
    total = float(best[n - 1, level])
    chosen = []
    b = n - 1
    while b > 0:
        a = int(from_cut[b, level])
        level = int(from_level[b, level])
        if a > 0:
            chosen.append(a)
        b = a
    return sorted(chosen), total


def smallest_budget(problem: CutProblem, levels: int = 120) -> float:
    """The least peak the model can reach: a minimax form of the same program.

    Each state keeps the largest segment peak on its way instead of the
    recomputation, with ``kept`` quantised into ``levels`` steps (rounding up,
    so the result never under-counts).  A first pass quantises the total
    output bytes; a second, the peak the first found, which is far smaller on
    a deep graph: the rounding then adds a fraction of a small checkpoint per
    cut instead of a fraction of the whole forward pass.  A peak found is a
    bound for the passes after it: a segment that allocates more cannot be
    on a better path, so those are skipped (a very coarse pass first gives
    the first bound; the result is the same, the passes cheaper).
    """
    total = float(problem.output_bytes[-1]) + problem.fixed_bytes + 1.0
    rough_levels = max(levels // 8, 1)
    bound = _minimax_peak(problem, total / rough_levels, rough_levels)
    coarse = min(bound, _minimax_peak(problem, total / levels, levels, bound))
    return min(coarse, _minimax_peak(problem, coarse / levels, levels, coarse))


def _minimax_peak(problem: CutProblem, quantum: float, levels: int,
                  bound: float = math.inf) -> float:
    """Least largest segment peak with ``kept`` below ``levels * quantum`` (inf if none);
    only segments allocating less than ``bound`` are considered."""
    n = len(problem)
    width = levels + 1
    best, shifted = _level_table(n, levels)
    best[0, 0] = 0.0
    # level_bytes[width - s][k] = (k - s) * quantum: the kept bytes at the source level
    level_bytes = sliding_window_view(np.arange(-width, width) * quantum, width)
    for b in range(1, n):
        work, kept, _ = problem.row(b)
        preds = np.flatnonzero(work < bound) if bound < math.inf else np.arange(b)
        if preds.size == 0:
            continue
        if b == n - 1:
            shift = np.zeros(preds.size, dtype=np.int64)
        else:
            shift = np.minimum(np.ceil(kept[preds] / quantum), width).astype(np.int64)
        start = width - shift
        # a level below the shift reads inf from the table: never chosen
        peak = np.maximum(shifted[preds, start], level_bytes[start] + work[preds][:, None])
        best[b] = peak.min(axis=0)
    return float(best[n - 1].min())


#: When :func:`smallest_budget`'s estimate is infeasible for :func:`least_recompute`,
#: the budget rises by this factor at a time (4% steps) until one is feasible.
FLOOR_RISE = 1.04
#: The bisection below the first feasible budget goes down to this fraction of the
#: estimate: the minimax program rounds up, so far lower budgets are not
#: feasible on the benchmark models.
FLOOR_LOWEST = 0.9


def refine_floor(problem: CutProblem, estimate: float, steps: int = 2, levels: int = 120,
                 max_rise: float = 1.5) -> tuple:
    """The least budget :func:`least_recompute` finds feasible, near ``estimate``.

    The two programs quantise differently, so ``estimate`` (from
    :func:`smallest_budget`) may be infeasible here: budgets then rise by
    ``FLOOR_RISE`` at a time, up to ``max_rise`` times it.  Then ``steps``
    bisections below the first feasible budget, down to ``FLOOR_LOWEST`` of
    ``estimate``.  Returns ``(budget, solution)``, the solution None if
    nothing up to the rise was feasible.
    """
    upper, lower = estimate, FLOOR_LOWEST * estimate
    solution = least_recompute(problem, upper, levels)
    while solution is None:
        if upper >= max_rise * estimate:
            return upper, None
        lower, upper = upper, upper * FLOOR_RISE
        solution = least_recompute(problem, upper, levels)
    for _ in range(steps):
        middle = (lower + upper) / 2
        found = least_recompute(problem, middle, levels)
        if found is None:
            lower = middle
        else:
            upper, solution = middle, found
    return upper, solution

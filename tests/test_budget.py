"""The dynamic programs of budget.py on hand-built problems of a few ops.

A problem is written as ops along a topological order, each with the bytes of
its output, the bytes some gradient holds of it, its work, the position of its
last consumer and the first position at which a gradient reads it (or what it
feeds; ``None``: never).  From that, :func:`cuts_of` builds the
:class:`cuts.Cuts` that :func:`cuts.live_cuts` would give, and :func:`Oracle`
states the memory model of budget.py directly, op by op and tensor by tensor:
a segment (a, b] allocates the outputs of its ops that run (first read at or
before b) plus twice its largest output plus the fixed bytes, and costs their
work; the kept bytes before it are those of the union of the tensors of the
chosen cuts up to a.  Brute force over every subset of cuts is the reference
the programs must meet.  No TensorFlow here: milliseconds per test.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from memory_saving_gradients import budget
from memory_saving_gradients.cuts import Cuts

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True)
class Op:
    bytes: int
    end: int  # position of its last consumer (its own position: none)
    first_read: int | None  # None: no gradient ever reads it or what it feeds
    work: int = 1
    held: int | None = None  # bytes a gradient reads; None: all of them


def _held(op: Op) -> int:
    return op.bytes if op.held is None else op.held


def cuts_of(ops: list, positions: list) -> Cuts:
    """The ``Cuts`` of a cut after each op at ``positions`` (what live_cuts records)."""
    runs = [op.first_read is not None for op in ops]

    def prefix(values):  # ops no gradient reads never run: left out of the sums
        return tuple(itertools.accumulate(v if r else 0 for v, r in zip(values, runs)))

    new_bytes, pruned = [], []
    for p in positions:
        live = [q for q in range(p + 1) if ops[q].end > p]
        new_bytes.append(tuple((q, ops[q].bytes) for q in live))
        pruned.append(tuple(
            (q, ops[q].work, ops[q].bytes, _held(ops[q])) for q in range(p + 1)
            if ops[q].first_read is not None and ops[q].first_read > p))
    return Cuts(
        positions=tuple(positions),
        tensors=tuple(() for _ in positions),  # the programs read bytes only
        new_bytes=tuple(new_bytes),
        output_bytes=prefix([op.bytes for op in ops]),
        work=prefix([op.work for op in ops]),
        largest=tuple(op.bytes for op in ops),
        pruned=tuple(pruned),
        held_bytes=prefix([_held(op) for op in ops]),
    )


class Oracle:
    """The memory model of budget.py, op by op, and brute force over all subsets."""

    def __init__(self, ops, positions, fixed=0, held_only=False):
        self.ops, self.positions, self.fixed, self.held_only = ops, positions, fixed, held_only

    def _position(self, candidate: int) -> int:
        """Candidate 0 is the start, 1..n the cuts, n + 1 the end."""
        if candidate == 0:
            return -1
        if candidate == len(self.positions) + 1:
            return len(self.ops) - 1
        return self.positions[candidate - 1]

    def _running(self, a: int, b: int) -> list:
        pa, pb = self._position(a), self._position(b)
        return [q for q in range(pa + 1, pb + 1)
                if self.ops[q].first_read is not None and self.ops[q].first_read <= pb]

    def segment_bytes(self, a: int, b: int) -> float:
        pa, pb = self._position(a), self._position(b)
        size = _held if self.held_only else (lambda op: op.bytes)
        outputs = sum(size(self.ops[q]) for q in self._running(a, b))
        return outputs + 2 * max(self.ops[q].bytes for q in range(pa + 1, pb + 1)) + self.fixed

    def cost(self, a: int, b: int) -> float:
        return sum(self.ops[q].work for q in self._running(a, b))

    def kept(self, chosen) -> int:
        """Bytes of the union of the tensors live at the chosen cuts."""
        tensors = {q for c in chosen for q in range(self._position(c) + 1)
                   if self.ops[q].end > self._position(c)}
        return sum(self.ops[q].bytes for q in tensors)

    def segments(self, chosen):
        """``(kept before, segment bytes, cost)`` of each segment of a choice of cuts."""
        path = [0] + sorted(chosen) + [len(self.positions) + 1]
        return [(self.kept(path[1:i + 1]), self.segment_bytes(a, b), self.cost(a, b))
                for i, (a, b) in enumerate(zip(path, path[1:]))]

    def fits(self, chosen, limit) -> bool:
        """What least_recompute requires of every segment: it allocates less than the
        budget, and with the kept bytes before it, no more."""
        return all(seg < limit and kept + seg <= limit for kept, seg, _ in self.segments(chosen))

    def peak(self, chosen) -> float:
        return max(kept + seg for kept, seg, _ in self.segments(chosen))

    def recompute(self, chosen) -> float:
        return sum(cost for _, _, cost in self.segments(chosen))

    def choices(self):
        cuts = range(1, len(self.positions) + 1)
        return [c for r in range(len(cuts) + 1) for c in itertools.combinations(cuts, r)]

    def least_recompute(self, limit):
        """Least recomputation of a choice that fits ``limit``, or None."""
        costs = [self.recompute(c) for c in self.choices() if self.fits(c, limit)]
        return min(costs, default=None)

    def least_peak(self) -> float:
        return min(self.peak(c) for c in self.choices())


def problem_of(ops, positions, fixed=0, held_only=False):
    return budget.CutProblem(cuts_of(ops, positions), fixed, held_only)


# A chain of 4 ops of 10 bytes, each read by its own gradient (tanh): a cut
# after each of the first three.
CHAIN = [Op(10, end=q + 1, first_read=q) for q in range(3)] + [Op(10, end=3, first_read=3)]
CHAIN_CUTS = [0, 1, 2]

# A diamond: op 0 feeds ops 1 and 2, which op 3 joins (an add: reads nothing).
DIAMOND = [Op(10, end=2, first_read=0), Op(20, end=3, first_read=1),
           Op(30, end=3, first_read=2), Op(5, end=3, first_read=None)]
DIAMOND_CUTS = [0, 1, 2]

# A skip connection: op 0 feeds op 1 and the add at op 3; op 1's output is read
# only by op 2's gradient (first read 2), op 2's by none (it feeds the add).
SKIP = [Op(10, end=3, first_read=0), Op(10, end=2, first_read=2, work=4),
        Op(10, end=3, first_read=None, work=4), Op(10, end=4, first_read=None), Op(1, end=4,
                                                                                first_read=None)]
SKIP_CUTS = [0, 1, 2, 3]

# Four ops whose gradients read nothing (adds, transposes), each feeding the next,
# then one whose gradient reads its input (op 3's output) and that nothing reads:
# a segment ending at the cut after op 3 runs none of its copies.
UNREAD_RUN = [Op(10, end=q + 1, first_read=4) for q in range(4)] + [Op(10, end=4, first_read=None)]
UNREAD_RUN_CUTS = [3]

HAND_BUILT = {"chain": (CHAIN, CHAIN_CUTS), "diamond": (DIAMOND, DIAMOND_CUTS),
              "skip": (SKIP, SKIP_CUTS), "unread_run": (UNREAD_RUN, UNREAD_RUN_CUTS)}


def test_chain_segments_by_hand():
    p = problem_of(CHAIN, CHAIN_CUTS)
    assert len(p) == 5  # start, three cuts, end
    # segment (start, cut after op 1]: ops 0 and 1 (20) plus twice the largest (20)
    assert p.row(2)[0][0] == 40
    # segment (cut after op 1, end]: ops 2 and 3
    assert p.row(4)[0][2] == 40
    # the whole pass as one segment
    assert p.row(4)[0][0] == 60
    # a chain keeps one tensor per cut, never one already kept
    assert list(p.row(3)[1]) == [10, 10, 10]
    assert list(p.row(4)[2]) == [4, 3, 2, 1]


def test_skip_connection_keeps_the_skipped_tensor_once():
    p = problem_of(SKIP, SKIP_CUTS)
    # cut 2 (after op 1) holds ops 0 and 1; cut 3 (after op 2) ops 0 and 2
    assert p.row(2)[1][0] == 20
    assert p.row(3)[1][0] == 20  # from the start: both tensors are new
    assert p.row(3)[1][2] == 10  # after cut 2: op 0's tensor is kept already
    assert p.row(3)[1][1] == 10  # after cut 1 (op 0 alone): the same


def test_skip_connection_prunes_copies_no_gradient_reads():
    p = problem_of(SKIP, SKIP_CUTS)
    # a segment ending after op 1 does not run op 1's copy (read first by op 2's
    # gradient), and op 2's copy runs in no segment
    assert p.row(2)[2][1] == 0
    assert p.row(2)[0][1] == 0 + 2 * 10
    assert p.row(3)[2][1] == 4
    assert p.row(5)[2][0] == 1 + 4


def test_chain_smallest_budget_by_hand():
    # by hand: one segment peaks at 60; a cut after op 1 or 2 (or after ops 0 and 2,
    # or 1 and 2) at 50; three cuts or the first two at 60
    oracle = Oracle(CHAIN, CHAIN_CUTS)
    assert oracle.least_peak() == 50
    found = budget.smallest_budget(problem_of(CHAIN, CHAIN_CUTS))
    assert 50 <= found <= 50 * (1 + 4 / 120)


def test_chain_least_recompute_at_the_least_budget():
    p = problem_of(CHAIN, CHAIN_CUTS)
    assert budget.least_recompute(p, 49.0, levels=49) is None
    cuts, work = budget.least_recompute(p, 50.0, levels=50)
    assert work == 4
    assert Oracle(CHAIN, CHAIN_CUTS).peak(cuts) <= 50
    # the whole pass as one segment allocates 60, which must be less than the budget;
    # of the choices that recompute as little, the one of least kept bytes: none
    assert budget.least_recompute(p, 60.0, levels=60)[0] != []
    assert budget.least_recompute(p, 61.0, levels=61) == ([], 4)


def test_no_budget_below_the_fixed_bytes():
    assert budget.least_recompute(problem_of(CHAIN, CHAIN_CUTS, fixed=100), 100.0) is None


@pytest.mark.parametrize("name", sorted(HAND_BUILT))
@pytest.mark.parametrize("held_only", [False, True])
def test_hand_built_problems_match_the_model_op_by_op(name, held_only):
    ops, positions = HAND_BUILT[name]
    oracle = Oracle(ops, positions, fixed=3, held_only=held_only)
    p = problem_of(ops, positions, fixed=3, held_only=held_only)
    for b in range(1, len(p)):
        segment, kept, cost = p.row(b)
        for a in range(b):
            assert segment[a] == oracle.segment_bytes(a, b), (a, b)
            assert cost[a] == oracle.cost(a, b), (a, b)
            if b <= len(positions):
                added = oracle.kept([a, b] if a else [b]) - oracle.kept([a] if a else [])
                assert kept[a] == added, (a, b)


def _check_least_recompute(ops, positions, fixed, held_only, limit):
    """least_recompute at an integer budget with one byte per level (no rounding)
    against brute force: feasible exactly when some choice fits, and then a choice
    that fits with the least recomputation."""
    oracle = Oracle(ops, positions, fixed, held_only)
    best = oracle.least_recompute(limit)
    found = budget.least_recompute(problem_of(ops, positions, fixed, held_only),
                                   float(limit), levels=limit)
    if best is None:
        assert found is None
        return
    assert found is not None, f"budget {limit}: brute force fits with recompute {best}"
    chosen, work = found
    assert oracle.fits(chosen, limit), (chosen, oracle.segments(chosen))
    assert work == oracle.recompute(chosen)
    assert work == best, (chosen, best)


def test_a_segment_of_copies_that_do_not_run_by_hand():
    # the cut after op 3 keeps 10 bytes; before it, no copy runs: twice the largest
    # output (20); after it, op 4's copy does not run either: 10 kept + 20
    oracle = Oracle(UNREAD_RUN, UNREAD_RUN_CUTS)
    assert oracle.segments([1]) == [(0, 20, 0), (10, 20, 0)]
    assert oracle.segments([]) == [(0, 40 + 20, 4)]
    p = problem_of(UNREAD_RUN, UNREAD_RUN_CUTS)
    assert p.row(1)[0][0] == 20 and p.row(2)[0][1] == 20


def test_least_recompute_sees_segments_whose_copies_do_not_run():
    _check_least_recompute(UNREAD_RUN, UNREAD_RUN_CUTS, 0, False, 30)


@pytest.mark.parametrize("name", sorted(HAND_BUILT))
def test_hand_built_least_recompute_equals_brute_force_at_every_budget(name):
    ops, positions = HAND_BUILT[name]
    for held_only in (False, True):
        for limit in range(1, 2 * sum(op.bytes for op in ops) + 10):
            _check_least_recompute(ops, positions, 0, held_only, limit)


def random_problem(rng: random.Random) -> tuple:
    """Ops of random sizes, lifetimes and first reads; a cut wherever something is live."""
    n = rng.randint(2, 8)
    ops = []
    for q in range(n):
        end = rng.randint(q, n - 1) if q < n - 1 else q
        first = rng.choice([None] + list(range(q, n)))
        size = rng.randint(1, 12)
        ops.append(Op(size, end, first, work=rng.randint(0, 5), held=rng.randint(0, size)))
    positions = [p for p in range(n - 1) if any(ops[q].end > p for q in range(p + 1))]
    positions = sorted(rng.sample(positions, rng.randint(0, len(positions))))
    return ops, positions


@pytest.mark.parametrize("seed", range(4))
def test_random_least_recompute_equals_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(60):
        ops, positions = random_problem(rng)
        fixed, held_only = rng.randint(0, 3), rng.random() < 0.5
        oracle = Oracle(ops, positions, fixed, held_only)
        least = math.ceil(oracle.least_peak())
        for limit in sorted({least - 1, least, least + 2, rng.randint(least, 2 * least)}):
            if limit > 0:
                _check_least_recompute(ops, positions, fixed, held_only, limit)


@pytest.mark.parametrize("seed", range(4))
def test_random_smallest_budget_is_the_least_peak_within_its_rounding(seed):
    """smallest_budget rounds the kept bytes up, a level at a time: never below the
    least peak, and above it by at most one level per cut on the way."""
    rng = random.Random(100 + seed)
    for _ in range(60):
        ops, positions = random_problem(rng)
        fixed, held_only = rng.randint(0, 3), rng.random() < 0.5
        least = Oracle(ops, positions, fixed, held_only).least_peak()
        p = problem_of(ops, positions, fixed, held_only)
        levels = 120
        found = budget.smallest_budget(p, levels)
        total = float(p.output_bytes[-1]) + fixed + 1.0
        # the second pass's levels are total / levels; the last pass's, found / levels or less
        second = least + len(positions) * total / levels
        assert least <= found <= least + len(positions) * second / levels, (ops, positions)


@pytest.mark.parametrize("seed", range(2))
def test_refine_floor_finds_a_feasible_budget_near_the_estimate(seed):
    rng = random.Random(200 + seed)
    for _ in range(40):
        ops, positions = random_problem(rng)
        p = problem_of(ops, positions)
        estimate = budget.smallest_budget(p)
        floor, solution = budget.refine_floor(p, estimate)
        assert 0.9 * estimate <= floor <= 1.5 * estimate
        assert solution is not None
        assert solution == budget.least_recompute(p, floor)
        assert Oracle(ops, positions).peak(solution[0]) <= floor + 1e-9 * floor

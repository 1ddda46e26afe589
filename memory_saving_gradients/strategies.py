"""Checkpoint selection policies.

Layer: analysis (read-only); imports: batch, budget, cuts, graph, ops, simulate, _gc,
_tensorflow, _units.

A strategy is a pure function ``(ys, xs, region, **options) -> list of tensors``
that reads the forward graph and returns the tensors to keep.  It never
changes the graph: the rewrite is done elsewhere, from whatever a strategy
returns, exactly as from a list the user gives.  New strategies register
with :func:`register`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from . import _gc, simulate
from . import batch as batch_lib
from . import budget as budget_lib
from . import cuts as cuts_lib
from . import graph as graph_lib
from . import ops as op_types
from ._tensorflow import tf
from ._units import describe_bytes
from .graph import ForwardRegion

Strategy = Callable[..., list]

COLLECTION_NAME = "checkpoints"

_STRATEGIES: dict = {}


def register(name: str) -> Callable[[Strategy], Strategy]:
    """Decorator: make ``fn`` available as ``checkpoints=name``."""

    def decorate(fn: Strategy) -> Strategy:
        _STRATEGIES[name] = fn
        return fn

    return decorate


def available() -> list:
    """Names accepted as ``checkpoints=...``."""
    return sorted(_STRATEGIES)


def get(name: str, hint: str = "") -> Strategy:
    """The strategy registered as ``name``; ValueError naming the known ones (and
    ``hint``, a sentence) for any other."""
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"Unknown checkpoint strategy {name!r}. Use one of {available()}, "
            f"or pass a list of tensors.{' ' + hint if hint else ''}"
        ) from None


@register("collection")
def collection(
    ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], region: ForwardRegion, **_: object
) -> list:
    """The tensors in the graph collection ``'checkpoints'``."""
    graph = ys[0].graph
    return [t for t in graph.get_collection(COLLECTION_NAME) if isinstance(t, tf.Tensor)]


#: Op types whose outputs 'speed' keeps: :data:`.ops.EXPENSIVE`.
EXPENSIVE_OP_TYPES = op_types.EXPENSIVE


@register("speed")
def speed(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], region: ForwardRegion, **_: object) -> list:
    """Outputs of convolutions and matrix products, and the branch points between them.

    Only the cheap ops are recomputed.  Tensors whose values several ops read (a
    residual stream, an attention input) are kept too: otherwise every
    segment would recompute back through them, and segments would overlap.  An
    op that reads only a shape (the ``Shape`` beside every reshape of a tensor
    whose batch is unknown) is not such a reader.
    """
    kept = []
    for op in region.order:
        if op.type in EXPENSIVE_OP_TYPES and op.outputs:
            kept.append(op.outputs[0])
            continue
        for t in op.outputs:
            if sum(1 for c in t.consumers()
                   if c in region and c.type not in op_types.SHAPE_ONLY_READERS) > 1:
                kept.append(t)
    return kept


@register("memory")
def memory(
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    region: ForwardRegion,
    memory_budget: float | None = None,
    unknown_dim: int = 1,
    **_: object,
) -> list:
    """The least memory: bottleneck cuts spaced by bytes, chosen by :mod:`.budget`.

    Without a budget: among the plans proposed, those whose predicted peak is
    within ``LEAST_PEAK_TOLERANCE`` (5%) of the least one found, and of those
    the one that recomputes least.  With ``memory_budget`` (bytes): the least
    recomputation whose predicted peak fits it; ValueError if none does.  For
    a trade of memory against recomputation, use ``'balanced'``.  A budget at or above
    plain ``tf.gradients``' predicted peak keeps nothing (plain gradients).
    ``unknown_dim=None`` (the graph's batch is unknown and not stated): the plan
    for every batch, :func:`any_batch_checkpoints`.
    """
    if unknown_dim is None:
        return any_batch_checkpoints(ys, xs, region, trade=False)
    return memory_checkpoints(ys, xs, region, memory_budget, unknown_dim, trade=False)


@register("balanced")
def balanced(
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    region: ForwardRegion,
    memory_budget: float | None = None,
    unknown_dim: int = 1,
    **_: object,
) -> list:
    """A trade between the least peak and recomputation.

    Each plan proposed is scored by its recomputation (in forward passes)
    plus ``MEMORY_WEIGHT`` times its peak (in least peaks), and the lowest
    score is taken, among plans whose peak exceeds the least one by at most
    ``MEMORY_SLACK`` of it (so at most twice it) and that keep ``1 -
    SAVING_SLACK`` of the largest saving.  So 10% more memory must buy 3% of
    a forward pass.  Both are relative to the least peak: the chosen peak
    grows with the model as the least one does (about sqrt(depth) on a chain
    or a residual net).  (``gradients`` accepts ``memory_budget`` with
    'memory' only; called directly with one, this is 'memory'.)
    ``unknown_dim=None`` (the batch is unknown and not stated): the trade made
    at the largest of ``batch.PLANNING_BATCHES``, where activations dominate.
    """
    if unknown_dim is None:
        unknown_dim = batch_lib.PLANNING_BATCHES[-1]
    return memory_checkpoints(ys, xs, region, memory_budget, unknown_dim, trade=True)


@_gc.without_cyclic_gc
def any_batch_checkpoints(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], region: ForwardRegion,
                          trade: bool = False,
                          batches: Sequence[int] = batch_lib.PLANNING_BATCHES) -> list:
    """'memory' for a graph whose batch (its unknown dimensions) is not known.

    A plan is made at each of ``batches``, and plain ``tf.gradients`` is a
    candidate too; each candidate's peak is simulated at every one of the
    batches.  Its worst ratio is the largest, over the batches, of its peak
    over the least peak any candidate has at that batch.  Among the
    candidates whose worst ratio is within ``LEAST_PEAK_TOLERANCE`` of the
    least one, the one that recomputes least (at the largest batch) is
    chosen: the plan that is near the least peak wherever the batch lands,
    not at one guess.  Exact at each batch judged: the simulation counts
    every unknown dimension as that batch.  Peaks are judged with the
    gradients of xs held to the end of the step, as :func:`plan` reports them
    and as a training step holds them until its optimizer applies them all
    (judged with each used at once, a plan's few held gradients would weigh
    more than every activation at a small batch, and nothing would be kept).
    """
    sizers = {b: simulate.Sizer(b) for b in batches}
    candidates = {(): []}
    for b in batches:
        chosen = memory_checkpoints(ys, xs, region, None, b, trade, sizer=sizers[b],
                                    drop_cuts=False)
        candidates.setdefault(tuple(t.ref() for t in chosen), chosen)
    peaks, recompute = {}, {}
    for key, tensors in candidates.items():
        row = []
        for b in batches:
            if tensors:
                predicted = simulate.predict_checkpointed(region, ys, xs, tensors, b, True,
                                                          sizers[b])
            else:
                predicted = simulate.predict_baseline(region, ys, xs, b, True, sizers[b])
            row.append(predicted.peak_bytes)
        peaks[key] = row
        recompute[key] = predicted.recompute_work  # at the largest batch
    least = [min(row[i] for row in peaks.values()) for i in range(len(batches))]
    worst = {key: max(p / max(low, 1) for p, low in zip(row, least))
             for key, row in peaks.items()}
    bound = min(worst.values()) * (1 + LEAST_PEAK_TOLERANCE)
    chosen = min((key for key in candidates if worst[key] <= bound),
                 key=lambda key: (recompute[key], worst[key]))
    return candidates[chosen]


#: Without a budget, 'memory' takes the least recomputation among plans whose
#: predicted peak is at most this fraction above the least one found.
LEAST_PEAK_TOLERANCE = 0.05

#: Without a budget, 'balanced' weighs one least peak of memory as this many
#: forward passes of recomputation ...
MEMORY_WEIGHT = 0.3
#: ... lets its peak exceed the least one by at most this fraction of it ...
MEMORY_SLACK = 1.0
#: ... and gives up at most this fraction of the largest saving it can reach
#: (plain tf.gradients' predicted peak minus the least peak).
SAVING_SLACK = 0.2
#: Scores closer than this (in forward passes) are ties, won by the lower peak.
SCORE_TIE = 0.02
#: Model budgets tried between the floor and the top of the slack.
SLACK_PROBES = 4
#: Model budgets just above the floor (as multiples of it) also tried for the least peak.
FLOOR_PROBES = (1.1,)
#: Times the plan of least peak found tries dropping one of its cuts, and how many of
#: them each time (see ``_Proposals.without_a_cut``).
DROP_PASSES = 2
DROPS_TRIED = 16
#: ... on graphs of at most this many ops between xs and ys (ResNet-56 has 368), where
#: those simulations are cheap.  On larger graphs they cost more than the rest of the
#: rewrite: ResNet-110 (719 ops, batch 2) built in 5.9x ``tf.gradients``' time with the
#: search against 2.2-2.9x without (``tests/test_planner_fidelity.py`` allows 4.5x), a
#: 4,000-op ResNet in 4.66x (``tests/test_rewrite_scaling.py`` allows 4x).
DROP_SEARCH_OPS = 400


def _spread(items: Sequence, count: int) -> list:
    """At most ``count`` of ``items``, evenly spread, the first and the last among them."""
    if len(items) <= count:
        return list(items)
    step = (len(items) - 1) / (count - 1)
    return [items[round(i * step)] for i in range(count)]


class Proposal(NamedTuple):
    """A plan proposed as checkpoints, and what simulating it found."""

    peak: int            # simulated peak bytes
    model_work: float    # recomputation as the dynamic program counts it (the simulated
                         # one for a plan the program did not propose)
    tensors: list        # the checkpoints
    work: float          # simulated recomputation
    cuts: tuple = ()     # the program's cut positions it keeps (none for a given list)


class Floor(NamedTuple):
    """A segment model's floor: the least budget its program finds feasible, and the
    proposal there."""

    problem: budget_lib.CutProblem
    budget: float
    proposal: Proposal


class _Proposals:
    """The plans the dynamic programs propose for one graph, each simulated once.

    Two models of a segment's bytes (see ``budget.CutProblem``) each propose;
    the simulation of :mod:`.simulate` judges every proposal.
    """

    def __init__(self, ys, xs, region, cuts, unknown_dim: int, fetched: bool,
                 size: simulate.Sizer, drop_cuts: bool = True):
        self.ys, self.xs, self.region = ys, xs, region
        self.drop_cuts = drop_cuts
        self.unknown_dim, self.fetched, self.size = unknown_dim, fetched, size
        fixed = sum(
            graph_lib.tensor_bytes(x, unknown_dim) for x in xs
            if graph_lib.is_float_or_complex(x)
        ) if fetched else 0
        self.problems = [budget_lib.CutProblem(cuts, fixed, held_only)
                         for held_only in (False, True)]
        self._recomputable = [tuple(t for t in ts if region.is_recomputable(t.op))
                              for ts in cuts.tensors]
        self._simulated: dict = {}

    @property
    def forward_work(self) -> float:
        """The modelled work of one forward pass."""
        return float(self.problems[0].work_prefix[-1])

    def baseline_peak(self) -> int:
        """Plain ``tf.gradients``' simulated peak."""
        return simulate.predict_baseline(self.region, self.ys, self.xs, self.unknown_dim,
                                         self.fetched, self.size).peak_bytes

    def at(self, problem, model_budget: float, solution=None,
           levels: int = budget_lib.DEFAULT_LEVELS) -> Proposal | None:
        """The proposal of ``problem``'s program at ``model_budget`` (or of its
        ``solution`` there), with ``kept`` in ``levels`` steps; None if the program
        finds none."""
        solution = solution or budget_lib.least_recompute(problem, model_budget, levels)
        if solution is None:
            return None
        chosen_cuts, model_work = solution
        return self._of_cuts(tuple(chosen_cuts), model_work)

    def _of_cuts(self, key: tuple, model_work: float | None = None) -> Proposal:
        """The proposal keeping the cut positions ``key``, simulated once (its
        ``model_work`` the simulated one where the program did not propose it)."""
        if key not in self._simulated:
            tensors = [t for i in key for t in self._recomputable[i - 1]]
            predicted = self._predict(tensors)
            work = predicted.recompute_work if model_work is None else model_work
            self._simulated[key] = Proposal(predicted.peak_bytes, work, tensors,
                                            predicted.recompute_work, key)
        return self._simulated[key]

    def without_a_cut(self, proposal: Proposal) -> Proposal:
        """``proposal``, or a plan of lower simulated peak found by dropping one of its
        cuts (at most :data:`DROPS_TRIED` of them, spread from the first to the last),
        repeated while that lowers it (at most :data:`DROP_PASSES` times); tried on
        graphs of at most :data:`DROP_SEARCH_OPS` ops.  The
        program's model of a segment's bytes is coarse: at a small batch, where weights
        and their gradients weigh as much as activations, it kept a cut whose tensors
        the simulation finds cost more than they save (eight conv-BN-ReLU layers at
        batch 8: 9.04 MB, 8.04 without the first convolution's output, where the same
        graph planned for every batch got 8.18)."""
        best = proposal
        for _ in range(DROP_PASSES):
            if len(best.cuts) < 2:
                break
            lower = min((self._of_cuts(tuple(c for c in best.cuts if c != dropped))
                         for dropped in _spread(best.cuts, DROPS_TRIED)),
                        key=lambda p: (p.peak, p.work))
            if lower.peak >= best.peak:
                break
            best = lower
        return best

    def of_tensors(self, tensors) -> Proposal | None:
        """A given list of checkpoints, simulated as a proposal (its ``model_work`` the
        simulated one), or None if none of them lies between xs and ys."""
        excluded = {t.ref() for t in list(self.ys) + list(self.xs)}
        kept = {}
        for t in tensors:
            if (t.ref() not in excluded and self.region.produces(t)
                    and self.region.is_recomputable(t.op)):
                kept.setdefault(t.ref(), t)
        if not kept:
            return None
        kept = sorted(kept.values(), key=graph_lib.tensor_order)
        predicted = self._predict(kept)
        return Proposal(predicted.peak_bytes, predicted.recompute_work, kept,
                        predicted.recompute_work)

    def _predict(self, tensors):
        return simulate.predict_checkpointed(self.region, self.ys, self.xs, tensors,
                                             self.unknown_dim, self.fetched, self.size)

    def floors(self) -> tuple:
        """``(floors, lowest)``: each model's :class:`Floor`, and the proposal of least
        simulated peak near them (None if no model has a floor).

        Near a floor, the simulated peak need not rise with the model's
        budget, so a few budgets just above it are tried too.
        """
        floors, found = [], []
        for problem in self.problems:
            floor, at_floor = budget_lib.refine_floor(problem,
                                                      budget_lib.smallest_budget(problem))
            if at_floor is None:
                continue
            floors.append(Floor(problem, floor, self.at(problem, floor, at_floor)))
            found += [floors[-1].proposal] + [self.at(problem, floor * f) for f in FLOOR_PROBES]
        found = [p for p in found if p]
        if not found:
            return floors, None
        lowest = min(found, key=lambda p: (p.peak, p.model_work))
        if self.drop_cuts and len(self.region.order) <= DROP_SEARCH_OPS:
            lowest = self.without_a_cut(lowest)
        return floors, lowest


@_gc.without_cyclic_gc
def memory_checkpoints(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], region: ForwardRegion,
                       memory_budget: float | None = None, unknown_dim: int = 1,
                       trade: bool = False, sizer: simulate.Sizer | None = None,
                       drop_cuts: bool = True) -> list:
    """The 'memory' (``trade=False``) or 'balanced' (``trade=True``) choice of checkpoints.

    The dynamic program of :mod:`.budget` uses a coarse model of a segment's
    memory; each plan it proposes is checked with the finer model of
    :mod:`.simulate`, which has the last word.  ``sizer``: a ``Sizer`` of
    ``unknown_dim`` to share with other predictions.  ``drop_cuts``: whether the plan
    of least peak found tries dropping its cuts (``_Proposals.without_a_cut``; the plan
    for every batch has the other batches' plans as candidates instead).
    """
    size = sizer or simulate.Sizer(unknown_dim)
    xs_refs = {x.ref() for x in xs}
    cuts = cuts_lib.live_cuts(region, size, size.cost, graph_lib.shares_input_buffer,
                              needs_gradient=graph_lib.needs_gradient_in(region, xs_refs))
    if not cuts.positions:
        return []
    # With a budget, plans are judged as plan() reports them: the gradients of
    # xs fetched, alive to the end.  Without one, as in a training step, where
    # each is used by its update at once (else large weights hide the saving).
    fetched = memory_budget is not None
    proposals = _Proposals(ys, xs, region, cuts, unknown_dim, fetched, size, drop_cuts)
    if memory_budget is None:
        return _unbudgeted_choice(proposals, trade)

    def least_peak_plan() -> list:
        """The 'memory' plan (made as without a budget), which may simulate lower with
        the gradients fetched than anything proposed with them."""
        return _unbudgeted_choice(
            _Proposals(ys, xs, region, cuts, unknown_dim, False, size, drop_cuts), False)

    return _budgeted_choice(proposals, memory_budget, least_peak_plan)


def _unbudgeted_choice(proposals: _Proposals, trade: bool) -> list:
    """Without a budget: near the least peak (``trade=False``), or the best trade."""
    baseline = proposals.baseline_peak()
    floors, lowest = proposals.floors()
    if lowest is None or baseline <= lowest.peak * (1 + LEAST_PEAK_TOLERANCE):
        return []  # plain tf.gradients is near the least peak, and recomputes nothing
    if trade:
        limit = lowest.peak + min(MEMORY_SLACK * lowest.peak,
                                  SAVING_SLACK * (baseline - lowest.peak))
    else:
        limit = lowest.peak * (1 + LEAST_PEAK_TOLERANCE)
    candidates = [lowest]
    for floor in floors:
        candidates += _probes(lambda b, problem=floor.problem: proposals.at(problem, b),
                              floor.budget, floor.proposal, limit)
    if trade:
        chosen = _best_trade(candidates, lowest.peak, limit, proposals.forward_work)
    else:
        chosen = _near_least_peak(candidates)
    return chosen.tensors if chosen.peak < baseline else lowest.tensors


def _near_least_peak(candidates: list) -> Proposal:
    """The least recomputation among the candidates within ``LEAST_PEAK_TOLERANCE`` of
    the least peak of all (a probe may simulate lower than the floors' plans)."""
    least = min(p.peak for p in candidates)
    return min((p for p in candidates if p.peak <= least * (1 + LEAST_PEAK_TOLERANCE)),
               key=lambda p: (p.model_work, p.peak))


def _least_work(proposals: list) -> Proposal:
    """The proposal of least simulated recomputation; the lower peak breaks ties."""
    return min(proposals, key=lambda p: (p.work, p.peak))


def _budgeted_choice(proposals: _Proposals, memory_budget,
                     least_peak_plan: Callable[[], list] = list) -> list:
    """With a budget: the least recomputation whose simulated peak fits it.

    Where none of the proposals fits, the 'memory' plan (``least_peak_plan()``) does
    if its peak does: a budget at 'memory''s predicted peak is met (its drop search,
    made without the gradients fetched, found a plan below every proposal with them:
    eight conv-BN-ReLU layers at batch 1, a helper's review).  Raises ValueError if
    none fits.
    """
    if proposals.baseline_peak() <= memory_budget:
        return []  # plain tf.gradients fits: nothing to recompute
    # Plans of other shapes: the DP's cuts are live sets along one order, and at
    # large budgets 'speed' (every convolution's output kept) can recompute less.
    others = [proposals.of_tensors(speed(proposals.ys, proposals.xs, proposals.region))]
    others = [p for p in others if p and p.peak <= memory_budget]
    fitting = []
    for problem in proposals.problems:
        for levels in BUDGET_LEVELS:
            fitting += _fitting_proposals(
                lambda b, problem=problem, levels=levels: proposals.at(problem, b, levels=levels),
                float(memory_budget))
    if fitting:
        return _least_work(fitting + others).tensors
    floors, lowest = proposals.floors()
    above = [lowest] + [proposals.at(floor.problem, floor.budget + ABOVE_FLOOR * memory_budget)
                        for floor in floors]
    above = [p for p in above if p]
    fitting = [p for p in above if p.peak <= memory_budget] + others
    if fitting:
        return _least_work(fitting).tensors
    least_plan = proposals.of_tensors(least_peak_plan())
    if least_plan is not None and least_plan.peak <= memory_budget:
        return least_plan.tensors
    least = min([p.peak for p in above] + ([least_plan.peak] if least_plan else []),
                default=float("nan"))
    raise ValueError(
        f"memory_budget={describe_bytes(memory_budget)}{_in_bytes(memory_budget)} cannot be "
        f"met: the smallest peak the memory model finds for this graph is "
        f"{describe_bytes(least)}{_in_bytes(least)}. Raise the budget, or reduce the batch size."
    )


def _in_bytes(count: float) -> str:
    """`` (N bytes)`` beside a figure :func:`describe_bytes` gave in MB."""
    return f" ({count:.0f} bytes)" if describe_bytes(count).endswith("MB") else ""


#: The program's grids of ``kept`` tried under a memory budget (steps per budget).
#: Each chosen cut rounds its kept bytes up by up to one step, so with tens of
#: checkpoints a coarse grid counts a good part of the budget that the plan never
#: uses (ResNet-110, batch 32, 48 MB: 120 steps gave a plan simulated at 46.3 MB
#: that recomputes 0.67 of a forward pass; 480 steps one at 47.1 MB and 0.59).  A
#: fine grid alone chose worse plans elsewhere (ResNet-56 at 0.3 of its baseline:
#: 0.43 against the coarse grid's 0.41), so the proposals of both are weighed.
BUDGET_LEVELS = (budget_lib.DEFAULT_LEVELS, 4 * budget_lib.DEFAULT_LEVELS)

#: When lowering the program's budget finds no plan that fits, one more proposal
#: per model: at its floor plus this fraction of the memory budget.
ABOVE_FLOOR = 0.15

#: Model budgets tried above the first that fits, while they still fit: the
#: program's model of a segment over-states some plans, so a larger model
#: budget can give a plan that fits too and recomputes less (ResNet-56, batch
#: 8: at 0.6 of the baseline the first fit was predicted at 17.98 MB with 0.127
#: of a forward pass recomputed; 0.8's plan, 17.48 MB and 0.123, fits as well).
UPWARD_PROBES = 2
#: The least factor by which each of those probes raises the program's budget
#: (by more where the last plan fits with room: by the budget over its peak).
UPWARD_STEP = 1.05
#: Tries at lowering the program's budget until a plan fits.
FIT_TRIES = 5
#: Each try lowers the program's budget by the ratio of the memory budget to the
#: last plan's simulated peak, times this factor, so that the next plan aims 3%
#: below the memory budget instead of at it.
FIT_UNDERSHOOT = 0.97


def _fitting_proposals(proposal, budget: float) -> list:
    """Proposals whose simulated peak fits ``budget``: the program's budget is lowered
    until one fits (at most ``FIT_TRIES`` tries), then raised while they still fit."""
    target, found = budget, None
    for _ in range(FIT_TRIES):
        found = proposal(target)
        if found is None or found.peak <= budget:
            break
        target *= FIT_UNDERSHOOT * budget / found.peak
    if found is None or found.peak > budget:
        return []
    fitting = [found]
    for _ in range(UPWARD_PROBES):
        target *= max(UPWARD_STEP, budget / max(found.peak, 1))
        found = proposal(target)
        if found is None or found.peak > budget:
            break
        fitting.append(found)
    return fitting


#: The largest model budget the probes try is this factor above ``limit`` scaled by
#: the floor's ratio of model budget to simulated peak: that ratio is measured at the
#: floor only, and the first probe whose plan peaks above ``limit`` ends the search.
PROBE_HEADROOM = 1.25


def _probes(proposal, floor, at_floor: Proposal, limit) -> list:
    """Proposals for up to ``SLACK_PROBES`` model budgets above ``floor``.

    Larger model budgets recompute less and peak higher; the model's budget
    and the simulated peak differ by a factor, measured at the floor, so the
    budgets are spaced evenly in ratio between the floor and ``limit``
    scaled by that factor (and ``PROBE_HEADROOM``).  The first proposal above
    ``limit`` ends the search.  ``at_floor``: the proposal at the floor.
    """
    scale = floor / max(at_floor.peak, 1)
    top = max(floor, limit * scale) * PROBE_HEADROOM
    found = []
    for k in range(1, SLACK_PROBES + 1):
        p = proposal(floor * (top / floor) ** (k / SLACK_PROBES))
        if p is None:
            continue
        found.append(p)
        if p.peak > limit:  # larger budgets peak higher still
            break
    return found


def _best_trade(candidates, least_peak, limit, forward_work) -> Proposal:
    """The candidate within ``limit`` of least ``recompute / forward + MEMORY_WEIGHT *
    peak / least_peak``; scores within ``SCORE_TIE`` of it count as equal, and
    the least peak among them is taken."""

    def score(p):
        return p.model_work / (forward_work or 1.0) + MEMORY_WEIGHT * p.peak / max(least_peak, 1)

    within = [p for p in candidates if p.peak <= limit]
    best = min(score(p) for p in within)
    return min((p for p in within if score(p) <= best + SCORE_TIE),
               key=lambda p: (p.peak, p.model_work))

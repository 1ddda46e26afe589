"""Checkpoint selection policies.

A strategy is a pure function ``(ys, xs, region, **options) -> list of tensors``
that reads the forward graph and returns the tensors to keep.  It never
changes the graph: the rewrite is done elsewhere, from whatever a strategy
returns, exactly as from a list the user gives.  New strategies register
with :func:`register`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ._tensorflow import tf
from . import _gc
from . import batch as batch_lib
from . import budget as budget_lib
from . import cuts as cuts_lib
from . import graph as graph_lib
from . import ops as op_types
from . import simulate
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


def get(name: str) -> Strategy:
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"Unknown checkpoint strategy {name!r}. Use one of {available()}, "
            "or pass a list of tensors."
        ) from None


@register("collection")
def collection(
    ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], region: ForwardRegion, **_
) -> list:
    """The tensors in the graph collection ``'checkpoints'``."""
    graph = ys[0].graph
    return [t for t in graph.get_collection(COLLECTION_NAME) if isinstance(t, tf.Tensor)]


#: Op types whose outputs 'speed' keeps: :data:`.ops.EXPENSIVE`.
EXPENSIVE_OP_TYPES = op_types.EXPENSIVE


@register("speed")
def speed(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], region: ForwardRegion, **_) -> list:
    """Outputs of convolutions and matrix products, and the branch points between them.

    Only the cheap ops are recomputed.  Tensors read by several ops (a
    residual stream, an attention input) are kept too: otherwise every
    segment would recompute back through them, and segments would overlap.
    """
    kept = []
    for op in region.order:
        if op.type in EXPENSIVE_OP_TYPES and op.outputs:
            kept.append(op.outputs[0])
            continue
        for t in op.outputs:
            if sum(1 for c in t.consumers() if c in region) > 1:
                kept.append(t)
    return kept


@register("memory")
def memory(
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    region: ForwardRegion,
    memory_budget: float | None = None,
    unknown_dim: int = 1,
    **_,
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
    **_,
) -> list:
    """A trade between the least peak and recomputation (what 'memory' did before).

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
def any_batch_checkpoints(ys, xs, region, trade: bool = False,
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
        chosen = memory_checkpoints(ys, xs, region, None, b, trade, sizer=sizers[b])
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


@_gc.without_cyclic_gc
def memory_checkpoints(ys, xs, region, memory_budget=None, unknown_dim: int = 1,
                       trade: bool = False, sizer: simulate.Sizer | None = None) -> list:
    """The 'memory' (``trade=False``) or 'balanced' (``trade=True``) choice of checkpoints.

    The dynamic program of :mod:`.budget` uses a coarse model of a segment's
    memory; each plan it proposes is checked with the finer model of
    :mod:`.simulate`, which has the last word.  ``sizer``: a ``Sizer`` of
    ``unknown_dim`` to share with other predictions.
    """
    size = sizer or simulate.Sizer(unknown_dim)
    xs_refs = {x.ref() for x in xs}
    cuts = cuts_lib.live_cuts(region, size, size.cost, simulate.ALIAS_OP_TYPES,
                              needs_gradient=lambda t: t.op in region or t.ref() in xs_refs)
    if not cuts.positions:
        return []
    # With a budget, plans are judged as plan() reports them: the gradients of
    # xs fetched, alive to the end.  Without one, as in a training step, where
    # each is used by its update at once (else large weights hide the saving).
    fetched = memory_budget is not None
    fixed = sum(
        graph_lib.tensor_bytes(x, unknown_dim) for x in xs if graph_lib.is_float_or_complex(x)
    ) if fetched else 0
    # Two models of a segment's bytes (see budget.CutProblem): each proposes,
    # the simulation judges every proposal.
    problems = [budget_lib.CutProblem(cuts, fixed, held_only) for held_only in (False, True)]

    simulated: dict = {}
    recomputable = [tuple(t for t in ts if region.is_recomputable(t.op)) for ts in cuts.tensors]

    def proposal(problem, model_budget, solution=None):
        solution = solution or budget_lib.least_recompute(problem, model_budget)
        if solution is None:
            return None
        key = tuple(solution[0])
        if key not in simulated:
            tensors = [t for i in solution[0] for t in recomputable[i - 1]]
            predicted = simulate.predict_checkpointed(
                region, ys, xs, tensors, unknown_dim, fetched, size
            )
            # (simulated peak, the program's recomputation, tensors, simulated recomputation)
            simulated[key] = (predicted.peak_bytes, solution[1], tensors,
                              predicted.recompute_work)
        return simulated[key]

    def least_feasible():
        """Each model's floor (the least budget its program finds feasible), and the
        plan of least simulated peak near them.

        Near a floor, the simulated peak need not rise with the model's
        budget, so a few budgets just above it are tried too.
        """
        floors, found = [], []
        for problem in problems:
            floor, at_floor = budget_lib.refine_floor(problem, budget_lib.smallest_budget(problem))
            if at_floor is None:
                continue
            floors.append((problem, floor, proposal(problem, floor, at_floor)))
            found += [floors[-1][2]] + [proposal(problem, floor * f) for f in FLOOR_PROBES]
        found = [p for p in found if p]
        return floors, min(found, key=lambda p: (p[0], p[1])) if found else None

    if memory_budget is None:
        baseline = simulate.predict_baseline(region, ys, xs, unknown_dim, fetched, size).peak_bytes
        floors, lowest = least_feasible()
        if lowest is None or lowest[0] >= baseline:
            return []
        if trade:
            limit = lowest[0] + min(MEMORY_SLACK * lowest[0],
                                    SAVING_SLACK * (baseline - lowest[0]))
        else:
            limit = lowest[0] * (1 + LEAST_PEAK_TOLERANCE)
        candidates = [lowest]
        for problem, floor, at_floor in floors:
            candidates += _probes(lambda b: proposal(problem, b), floor, at_floor, limit)
        if trade:
            chosen = _best_trade(candidates, lowest[0], limit, float(problems[0].work_prefix[-1]))
        else:
            # a probe may simulate lower than the floors' plans: 5% of the least of all
            least = min(p[0] for p in candidates)
            chosen = min((p for p in candidates if p[0] <= least * (1 + LEAST_PEAK_TOLERANCE)),
                         key=lambda p: (p[1], p[0]))
        return chosen[2] if chosen[0] < baseline else lowest[2]
    if simulate.predict_baseline(region, ys, xs, unknown_dim, fetched, size).peak_bytes <= \
            memory_budget:
        return []  # plain tf.gradients fits: nothing to recompute
    # Plans of other shapes: the DP's cuts are live sets along one order, and at
    # large budgets 'speed' (every convolution's output kept) can recompute less.
    others = [_simulated(region, ys, xs, speed(ys, xs, region), unknown_dim, fetched, size)]
    others = [p for p in others if p and p[0] <= memory_budget]
    fitting = []
    for problem in problems:
        fitting += _fitting_proposals(lambda b, problem=problem: proposal(problem, b),
                                      float(memory_budget))
    if fitting:
        return min(fitting + others, key=lambda p: (p[3], p[0]))[2]
    floors, lowest = least_feasible()
    proposals = [lowest] + [proposal(problem, floor + 0.15 * memory_budget)
                            for problem, floor, _ in floors]
    proposals = [p for p in proposals if p]
    fitting = [p for p in proposals if p[0] <= memory_budget] + others
    if fitting:
        return min(fitting, key=lambda p: (p[3], p[0]))[2]
    lowest = min((p[0] for p in proposals), default=float("nan"))
    raise ValueError(
        f"memory_budget={memory_budget / 2**20:.1f} MB cannot be met: the smallest peak "
        f"the memory model finds for this graph is {lowest / 2**20:.1f} MB "
        f"({lowest} bytes). Raise the budget, or reduce the batch size."
    )


#: Model budgets tried above the first that fits, while they still fit: the
#: program's model of a segment over-states some plans, so a larger model
#: budget can give a plan that fits too and recomputes less (ResNet-56, batch
#: 8: at 0.6 of the baseline the first fit was predicted at 17.98 MB with 0.127
#: of a forward pass recomputed; 0.8's plan, 17.48 MB and 0.123, fits as well).
UPWARD_PROBES = 2


def _fitting_proposals(proposal, budget: float) -> list:
    """Proposals whose simulated peak fits ``budget``: the program's budget is lowered
    until one fits (at most 5 tries), then raised while they still fit."""
    target, found = budget, None
    for _ in range(5):
        found = proposal(target)
        if found is None or found[0] <= budget:
            break
        target *= 0.97 * budget / found[0]
    if found is None or found[0] > budget:
        return []
    fitting = [found]
    for _ in range(UPWARD_PROBES):
        target *= max(1.05, budget / max(found[0], 1))
        found = proposal(target)
        if found is None or found[0] > budget:
            break
        fitting.append(found)
    return fitting


def _simulated(region, ys, xs, tensors, unknown_dim, fetched, size):
    """``(peak, recompute work, tensors, recompute work)`` of a given list of checkpoints
    (the shape of the planner's proposals, simulated), or None if
    none of them lies between xs and ys."""
    excluded = {t.ref() for t in list(ys) + list(xs)}
    kept = {}
    for t in tensors:
        if t.ref() not in excluded and region.produces(t) and region.is_recomputable(t.op):
            kept.setdefault(t.ref(), t)
    if not kept:
        return None
    kept = sorted(kept.values(), key=graph_lib.tensor_order)
    predicted = simulate.predict_checkpointed(region, ys, xs, kept, unknown_dim, fetched, size)
    return predicted.peak_bytes, predicted.recompute_work, kept, predicted.recompute_work


def _probes(proposal, floor, at_floor, limit) -> list:
    """Proposals for up to ``SLACK_PROBES`` model budgets above ``floor``.

    Larger model budgets recompute less and peak higher; the model's budget
    and the simulated peak differ by a factor, measured at the floor, so the
    budgets are spaced evenly in ratio between the floor and ``limit``
    scaled by that factor.  The first proposal above ``limit`` ends the search.
    ``at_floor``: the proposal at the floor.
    """
    scale = floor / max(at_floor[0], 1)
    top = max(floor, limit * scale) * 1.25
    found = []
    for k in range(1, SLACK_PROBES + 1):
        p = proposal(floor * (top / floor) ** (k / SLACK_PROBES))
        if p is None:
            continue
        found.append(p)
        if p[0] > limit:  # larger budgets peak higher still
            break
    return found


def _best_trade(candidates, least_peak, limit, forward_work):
    """The candidate within ``limit`` of least ``recompute / forward + MEMORY_WEIGHT *
    peak / least_peak``; scores within ``SCORE_TIE`` of it count as equal, and
    the least peak among them is taken."""

    def score(p):
        return p[1] / max(forward_work, 1.0) + MEMORY_WEIGHT * p[0] / max(least_peak, 1)

    within = [p for p in candidates if p[0] <= limit]
    best = min(score(p) for p in within)
    return min((p for p in within if score(p) <= best + SCORE_TIE), key=lambda p: (p[0], p[1]))

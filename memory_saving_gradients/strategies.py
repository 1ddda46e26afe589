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
from . import budget as budget_lib
from . import cuts as cuts_lib
from . import graph as graph_lib
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


# Op types whose outputs 'speed' keeps: the expensive ones to recompute.
EXPENSIVE_OP_TYPES = frozenset(
    {
        "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
        "Conv3DBackpropInputV2", "_FusedConv2D", "MatMul", "_FusedMatMul",
        "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    }
)


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
    **_,
) -> list:
    """Bottleneck cuts spaced by bytes, chosen by :mod:`.budget`.

    Without a budget: the plan with the least recomputation whose predicted
    peak is within ``MEMORY_SLACK`` (a tenth) of plain ``tf.gradients``' peak
    above the least peak the memory model can reach, when that saves at least
    ``MIN_SAVING`` of a forward pass; else the least peak.  With ``memory_budget``
    (bytes): the least recomputation whose predicted peak fits it; ValueError
    if none does.
    """
    return memory_checkpoints(ys, xs, region, memory_budget)


#: Without a budget, 'memory' may give up this fraction of plain tf.gradients'
#: predicted peak, above the least peak it finds, to recompute less.
MEMORY_SLACK = 0.1
#: ... but only for a saving of at least this fraction of a forward pass's work.
MIN_SAVING = 0.05


def memory_checkpoints(ys, xs, region, memory_budget=None, unknown_dim: int = 1) -> list:
    """The 'memory' strategy's choice of checkpoint tensors.

    The dynamic program of :mod:`.budget` uses a coarse model of a segment's
    memory; each plan it proposes is checked with the finer model of
    :mod:`.simulate`, which has the last word.
    """
    size = simulate.Sizer(unknown_dim)
    cuts = cuts_lib.live_cuts(region, size, size.cost, simulate.ALIAS_OP_TYPES)
    if not cuts.positions:
        return []
    # With a budget, plans are judged as plan() reports them: the gradients of
    # xs fetched, alive to the end.  Without one, as in a training step, where
    # each is used by its update at once (else large weights hide the saving).
    fetched = memory_budget is not None
    fixed = sum(
        graph_lib.tensor_bytes(x, unknown_dim) for x in xs if graph_lib.is_differentiable(x)
    ) if fetched else 0
    problem = budget_lib.CutProblem(cuts, fixed)

    simulated: dict = {}

    def proposal(model_budget, solution=None):
        solution = solution or budget_lib.least_recompute(problem, model_budget)
        if solution is None:
            return None
        key = tuple(solution[0])
        if key not in simulated:
            tensors = [
                t for i in solution[0] for t in cuts.tensors[i - 1]
                if graph_lib.is_recomputable(t.op)
            ]
            peak = simulate.predict_checkpointed(
                region, ys, xs, tensors, unknown_dim, fetched, size
            ).peak_bytes
            simulated[key] = (peak, solution[1], tensors)
        return simulated[key]

    def least_feasible():
        """The plan at the least model budget the dynamic program finds feasible."""
        floor, at_floor = budget_lib.refine_floor(problem, budget_lib.smallest_budget(problem))
        for _ in range(3):  # the two programs quantise differently: step up if needed
            if at_floor is not None:
                break
            floor *= 1.15
            at_floor = budget_lib.least_recompute(problem, floor)
        return floor, proposal(floor, at_floor)

    if memory_budget is None:
        baseline = simulate.predict_baseline(region, ys, xs, unknown_dim, fetched, size).peak_bytes
        slack = MEMORY_SLACK * baseline
        floor, lowest = least_feasible()
        if lowest is None:
            return []
        chosen = lowest
        # Larger budgets recompute less: take the largest whose plan stays within
        # the slack, if it saves a worthwhile part of a forward pass.
        worthwhile = MIN_SAVING * float(problem.work_prefix[-1])
        for extra in (1.5 * slack, slack, 0.5 * slack):
            found = proposal(floor + extra)
            if found and found[0] <= lowest[0] + slack and found[0] < baseline:
                if found[1] <= lowest[1] - worthwhile:
                    chosen = found
                break
        if chosen[0] >= baseline:
            return []
        return chosen[2]
    target = float(memory_budget)
    for _ in range(5):
        found = proposal(target)
        if found is None:
            break
        if found[0] <= memory_budget:
            return found[2]
        target *= 0.97 * memory_budget / found[0]
    floor, lowest = least_feasible()
    proposals = [p for p in (lowest, proposal(floor + 0.15 * memory_budget)) if p]
    fitting = [p for p in proposals if p[0] <= memory_budget]
    if fitting:
        return min(fitting, key=lambda p: (p[1], p[0]))[2]
    lowest = min((p[0] for p in proposals), default=float("nan"))
    raise ValueError(
        f"memory_budget={memory_budget / 2**20:.1f} MB cannot be met: the smallest peak "
        f"the memory model finds for this graph is {lowest / 2**20:.1f} MB "
        f"({lowest} bytes). Raise the budget, or reduce the batch size."
    )

"""``plan()``: what ``gradients()`` would keep and what it would cost, without changing the graph."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from . import _gc
from . import graph as graph_lib
from . import simulate


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checkpointing plan and the memory model's prediction for it.

    Attributes:
      checkpoints: the tensors kept from the forward pass.
      predicted_peak_bytes: predicted peak of the backward pass with them.
      baseline_peak_bytes: predicted peak of plain ``tf.gradients``.
      recompute_cost: extra forward work, as a fraction of one forward pass.
      strategy: the strategy name, or ``'list'`` for tensors given by the user.
      assumptions: what the memory model had to assume (unknown dimensions).
      recomputed_ops: ``(op type, count)`` of the copies the backward pass runs,
        most frequent first (copies that nothing reads are pruned, not run).
    """

    checkpoints: tuple
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    recompute_cost: float
    strategy: str
    assumptions: tuple = ()
    recomputed_ops: tuple = ()

    @property
    def predicted_ratio(self) -> float:
        """Predicted peak as a fraction of plain ``tf.gradients``' peak."""
        return self.predicted_peak_bytes / max(self.baseline_peak_bytes, 1)

    def __str__(self) -> str:
        mb = 2.0**20
        lines = [
            f"Plan ({self.strategy}): {len(self.checkpoints)} checkpoints, predicted peak "
            f"{self.predicted_peak_bytes / mb:.1f} MB vs {self.baseline_peak_bytes / mb:.1f} MB "
            f"for tf.gradients ({self.predicted_ratio:.2f}x), recomputation "
            f"{self.recompute_cost:.2f} of a forward pass",
        ]
        if self.recomputed_ops:
            lines.append(
                "  recomputes: " + ", ".join(f"{n} {kind}" for kind, n in self.recomputed_ops)
            )
        for t in self.checkpoints:
            lines.append(
                f"  {t.name:<60s} {str(t.shape):<22s} {graph_lib.tensor_bytes(t) / mb:9.2f} MB"
            )
        lines.extend(f"  assumed: {a}" for a in self.assumptions)
        return "\n".join(lines)


@_gc.without_cyclic_gc
def make_plan(
    ys, xs, region, checkpoints: Sequence, strategy: str, unknown_dim: int = 1,
    onednn: bool = True, gpu: bool = False,
) -> Plan:
    """Predict both peaks for a chosen set of checkpoints (pure: nothing is built);
    unknown dimensions count as ``unknown_dim``; ``onednn`` and ``gpu`` describe
    the machine (see :func:`simulate.workspace_note`)."""
    predicted = simulate.predict_checkpointed(region, ys, xs, checkpoints, unknown_dim)
    baseline = simulate.predict_baseline(region, ys, xs, unknown_dim)
    return Plan(
        checkpoints=tuple(checkpoints),
        predicted_peak_bytes=predicted.peak_bytes,
        baseline_peak_bytes=baseline.peak_bytes,
        recompute_cost=predicted.recompute_cost,
        strategy=strategy,
        assumptions=tuple(sorted(set(predicted.assumptions + baseline.assumptions)))
        + simulate.workspace_note(region, onednn, gpu),
        recomputed_ops=predicted.recomputed_ops,
    )

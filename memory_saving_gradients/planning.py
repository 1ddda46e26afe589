"""``plan()``: what ``gradients()`` would keep and what it would cost, without changing the graph.

Layer: analysis (read-only); imports: batch, graph, notices, schedule, simulate, _gc (_tensorflow
for type hints only).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Sequence

from . import _gc, notices, simulate, terms
from . import batch as batch_lib
from . import graph as graph_lib
from . import schedule as schedule_lib
from ._units import MIB

if TYPE_CHECKING:
    from ._tensorflow import tf


#: ``str(plan)`` and the INFO line give the in-step peaks when their ratio differs from
#: the fetched one by at least this much.
IN_STEP_NOTE_DIFFERENCE = 0.02


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checkpointing plan and the memory model's prediction for it.

    Attributes:
      checkpoints: the tensors kept from the forward pass.
      predicted_peak_bytes: predicted peak of the backward pass with them.
      baseline_peak_bytes: predicted peak of plain ``tf.gradients``.
      recompute_cost: the recomputation's time (the time model's seconds, :mod:`.timing`),
        as a fraction of one forward pass's.
      strategy: the strategy name, or ``'list'`` for tensors given by the user.
      assumptions: what the memory model had to assume (unknown dimensions).
      recomputed_ops: ``(op type, count)`` of the copies the backward pass runs,
        most frequent first (copies that nothing reads are pruned, not run).  A
        step that fetches ys runs these beyond plain's ops; one that fetches only the
        gradients runs fewer, since grappler then prunes the forward ops above the
        last checkpoint, which only their copies feed.
      batch: on a graph with unknown dimensions (an unknown batch), the batch the
        two peaks above are predicted at; None when every shape is known, or every
        unknown one is bounded by a known tensor (a slice of it; the assumptions name
        the bound).
        :meth:`peak_at` and :meth:`largest_batch` answer for any batch.
      predicted_step_ratio: the time model's (:mod:`.timing`) time of the forward and
        backward pass with this plan's recomputation over plain ``tf.gradients``' (the
        region's ops only: not the optimizer's update or the input pipeline); each
        kernel's bytes cost less where the memory model's replay finds them in the
        last-level cache (:mod:`.step_time`).
      schedule: the backward schedule (:class:`.schedule.Schedule`) the prediction
        replays and ``gradients()`` builds: its ``steps``, in order, and
        ``describe()`` them by name.
      in_step_peak_bytes, in_step_baseline_peak_bytes: the two peaks again, in a
        training step that uses each gradient of xs as soon as it is made (an
        optimizer's update) and frees it, where the two peaks above keep every
        gradient to the end (fetched, as ``session.run(grads)`` does).  Without a
        ``memory_budget`` the strategies weigh plans by these: on a model whose
        weights outweigh its activations the fetched gradients hide the saving.
      batch_stated: whether :attr:`batch` is the ``batch_size=`` the caller passed
        (else the library chose it: 32, or the largest a ``memory_budget`` allows).
    """

    checkpoints: tuple
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    recompute_cost: float
    strategy: str
    assumptions: tuple = ()
    recomputed_ops: tuple = ()
    batch: int | None = None
    predicted_step_ratio: float = 1.0
    schedule: schedule_lib.Schedule | None = dataclasses.field(
        default=None, repr=False, compare=False)
    in_step_peak_bytes: int | None = None
    in_step_baseline_peak_bytes: int | None = None
    batch_stated: bool = False
    _model: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def in_step_ratio(self) -> float | None:
        """``in_step_peak_bytes`` as a fraction of ``in_step_baseline_peak_bytes``."""
        if self.in_step_peak_bytes is None or self.in_step_baseline_peak_bytes is None:
            return None
        return self.in_step_peak_bytes / max(self.in_step_baseline_peak_bytes, 1)

    def in_step_differs(self) -> bool:
        """Whether the in-step ratio differs from :attr:`predicted_ratio` enough to say."""
        ratio = self.in_step_ratio
        return ratio is not None and abs(ratio - self.predicted_ratio) >= IN_STEP_NOTE_DIFFERENCE

    @property
    def checkpoint_bytes(self) -> int:
        """The checkpoints' bytes together, as the memory model sizes them (at
        :attr:`batch` where the graph has unknown sizes), each buffer once (a kept
        tensor and a reshape of it share one): per-channel statistics and other small
        tensors count in :attr:`checkpoints` but weigh little here."""
        size = simulate.Sizer(self.batch or 1)
        # a reshape of a kept tensor (a tensordot's result and its matmul) is one buffer
        buffers = {root.ref(): root for root in map(graph_lib.buffer_root, self.checkpoints)}
        return sum(size(t) for t in buffers.values())

    @property
    def batch_known(self) -> bool:
        """Whether the peaks do not depend on a batch: the graph's shapes are fully known,
        or bounded by known tensors."""
        return self.batch is None

    def peak_at(self, batch: int, plain: bool = False, in_step: bool = False) -> int:
        """Predicted peak bytes when the graph is fed at ``batch`` (every unknown
        dimension counted as ``batch``): of this plan, or of plain ``tf.gradients``
        (``plain=True``); with the gradients fetched (as ``predicted_peak_bytes``), or
        with ``in_step=True`` in a training step that applies each as it is made (as
        ``in_step_peak_bytes``).  On a graph without unknown dimensions, the same at
        every batch.  ValueError unless ``batch`` is a positive integer."""
        batch_lib.checked_batch(batch)
        if self._model is None:
            if in_step:
                return self.in_step_baseline_peak_bytes if plain else self.in_step_peak_bytes
            return self.baseline_peak_bytes if plain else self.predicted_peak_bytes
        return (self._in_step_model if in_step else self._model).peak_at(batch, plain)

    def ratios_by_batch(self, in_step: bool = False) -> tuple:
        """``((batch, predicted peak over plain's), ...)`` at the batches the planner
        judges (``batch.PLANNING_BATCHES``); see :meth:`peak_at`."""
        return tuple((b, self.peak_at(b, in_step=in_step)
                      / max(self.peak_at(b, plain=True, in_step=in_step), 1))
                     for b in batch_lib.PLANNING_BATCHES)

    @property
    def depends_on_batch(self) -> bool:
        """Whether the predicted peaks change with the unknown size (False where every
        shape is known, or where the unknown sizes are bounded: a slice of a known
        tensor)."""
        if self.batch is None or self._model is None:
            return False
        peaks = {(self.peak_at(b), self.peak_at(b, plain=True))
                 for b in batch_lib.PLANNING_BATCHES}
        return len(peaks) > 1

    @functools.cached_property
    def _in_step_model(self) -> batch_lib.PeakModel:
        """:attr:`_model` with each gradient used as it is made (not fetched)."""
        model = self._model
        return batch_lib.PeakModel(model.region, model.ys, model.xs, model.checkpoints,
                                   fetched=False, stops=model.stops, schedule=model.schedule)

    def largest_batch(self, memory_bytes: float, plain: bool = False,
                      fixed_bytes: float = 0, per_example_bytes: float = 0,
                      headroom: float | None = None) -> int:
        """The largest batch whose predicted peak (of this plan, or of plain
        ``tf.gradients`` with ``plain=True``) fits ``memory_bytes``; 0 if none does.

        The peak counts ``headroom`` more (``batch.HEADROOM``, 15%, unless given):
        what the model leaves out.  ``fixed_bytes`` and ``per_example_bytes * batch``
        are added to it: what the step needs besides the allocations the model
        counts (e.g. weights and optimizer slots allocated before the step, the
        input batch).  Raises ValueError on a graph whose batch is fixed (no
        unknown dimension), and on a memory that is not a positive number of bytes.
        The search stops at ``batch.BATCH_LIMIT`` (2**24), and warns where that fits.
        """
        memory_bytes = batch_lib.checked_bytes(memory_bytes, "memory_bytes")
        batch_lib.checked_bytes(fixed_bytes, "fixed_bytes", positive=False)
        batch_lib.checked_bytes(per_example_bytes, "per_example_bytes", positive=False)
        if headroom is not None and (not isinstance(headroom, (int, float)) or headroom < 0):
            raise ValueError(f"headroom must be a fraction of at least 0; got {headroom!r}.")
        if self._model is None or self.batch is None:
            raise ValueError(
                "largest_batch needs a graph whose batch dimension is unknown (None) when "
                "traced: this graph's shapes are fully known, or each unknown one is bounded "
                "by a known tensor (a slice of it: see the plan's assumptions), so its peak "
                "does not depend on a batch. Trace the step with a [None, ...] input."
            )
        found = self._model.largest_batch(memory_bytes, plain, fixed_bytes, per_example_bytes,
                                          headroom)
        if found >= batch_lib.BATCH_LIMIT:
            notices.warn(
                f"largest_batch: every batch up to {batch_lib.BATCH_LIMIT}, the largest it "
                f"considers, fits {memory_bytes / MIB:.0f} MB; the answer is that limit, not "
                "the largest batch that fits. Check the memory you passed is in bytes.",
                notices.MemorySavingGradientsWarning)
        return found

    @property
    def predicted_ratio(self) -> float:
        """Predicted peak as a fraction of plain ``tf.gradients``' peak."""
        return self.predicted_peak_bytes / max(self.baseline_peak_bytes, 1)

    def __str__(self) -> str:
        mb = MIB
        lines = [
            f"Plan ({self.strategy}): {len(self.checkpoints)} checkpoints "
            f"({self.checkpoint_bytes / mb:.2f} MB), predicted peak "
            f"{self.predicted_peak_bytes / mb:.1f} MB vs {self.baseline_peak_bytes / mb:.1f} MB "
            f"for tf.gradients ({self.predicted_ratio:.2f}x), recomputation "
            f"{self.recompute_cost:.2f} of a forward pass, predicted step time "
            f"{self.predicted_step_ratio:.2f}x",
        ]
        if self.in_step_differs():
            lines.append(
                f"  in a training step that applies each gradient as it is made: predicted peak "
                f"{self.in_step_peak_bytes / mb:.1f} MB vs {self.in_step_baseline_peak_bytes / mb:.1f} MB "
                f"({self.in_step_ratio:.2f}x)")
        if self.recomputed_ops:
            lines.append(
                "  recomputes: " + ", ".join(f"{n} {kind}" for kind, n in self.recomputed_ops)
            )
        size = simulate.Sizer(self.batch or 1)  # as the memory model sizes them
        for t in self.checkpoints:
            lines.append(f"  {t.name:<60s} {str(t.shape):<22s} {size(t) / mb:9.2f} MB")
        lines.extend(f"  assumed: {a}" for a in self.assumptions)
        if self.depends_on_batch:
            lines.append("  predicted peak by batch (this plan / tf.gradients): " + ", ".join(
                f"{b}: {self.peak_at(b) / mb:.1f} / {self.peak_at(b, plain=True) / mb:.1f} MB"
                for b in batch_lib.PLANNING_BATCHES))
        return "\n".join(lines)


def _step_ratio(predicted: simulate.Prediction, baseline: simulate.Prediction) -> float:
    """The predicted step time over plain ``tf.gradients``': every kernel each replay
    ran, with the cache term (:func:`simulate.timed_seconds`)."""
    if not (predicted.timed_seconds and baseline.timed_seconds):
        return predicted.step_time_ratio  # nothing kept: the baseline itself, 1.0
    return predicted.timed_seconds / baseline.timed_seconds


@_gc.without_cyclic_gc
def make_plan(
    ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], region: graph_lib.ForwardRegion,
    checkpoints: Sequence[tf.Tensor], strategy: str, unknown_dim: int = 1,
    onednn: bool = True, gpu: bool = False, batch_known: bool = True, batch_note: tuple = (),
    stops: Sequence[tf.Tensor] = (), schedule: schedule_lib.Schedule | None = None,
    batch_stated: bool = False,
) -> Plan:
    """Predict both peaks for a chosen set of checkpoints (pure: nothing is built);
    unknown dimensions count as ``unknown_dim``; ``onednn`` and ``gpu`` describe
    the machine (see :func:`simulate.workspace_note`).  ``batch_known``: the graph
    has no unknown dimension; ``batch_note``: how the batch was chosen, for
    ``assumptions`` (a loop without a static trip count makes the figures depend on
    it all the same); ``stops``: the ``stop_gradients``; ``schedule``: the backward
    schedule of these checkpoints and stops, when already worked out; ``batch_stated``:
    ``unknown_dim`` is the ``batch_size=`` the caller passed."""
    sizer = simulate.Sizer(unknown_dim, stated=batch_stated)
    baseline, in_step_baseline = (
        simulate.predict_baseline(region, ys, xs, unknown_dim, fetched, sizer, timed=fetched)
        for fetched in (True, False))
    if checkpoints:
        if schedule is None:
            schedule = schedule_lib.backward_schedule(region, ys, xs, checkpoints, stops)
        predicted, in_step = (
            simulate.predict_checkpointed(region, ys, xs, checkpoints, unknown_dim, fetched,
                                          sizer, stops, schedule, timed=fetched)
            for fetched in (True, False))
    else:  # nothing kept: gradients() calls plain tf.gradients, and so does this plan
        schedule, predicted, in_step = None, baseline, in_step_baseline
    model = batch_lib.PeakModel(region, ys, xs, checkpoints, stops=stops, schedule=schedule)
    # a while loop run as many times as a tensor says: its steps are counted as the
    # unknown size even where every shape is known
    batch_known = batch_known and not sizer.loops_assumed
    if batch_stated and not sizer.assumed and not sizer.loops_assumed:
        batch_note = tuple(batch_note) + (
            f"batch_size={unknown_dim} changes nothing here: every size in the graph is known "
            "(or bounded by known ones), and the figures are at those sizes",)
    return Plan(
        checkpoints=tuple(checkpoints),
        predicted_peak_bytes=predicted.peak_bytes,
        baseline_peak_bytes=baseline.peak_bytes,
        recompute_cost=predicted.recompute_cost,
        predicted_step_ratio=_step_ratio(predicted, baseline),
        strategy=strategy,
        assumptions=tuple(sorted(set(predicted.assumptions + baseline.assumptions)))
        + tuple(batch_note) + simulate.workspace_note(region, onednn, gpu)
        + simulate.loop_note(region) + simulate.python_function_note(region)
        + terms.note(region, ys, xs, sizer),
        recomputed_ops=predicted.recomputed_ops,
        batch=None if batch_known else int(unknown_dim),
        schedule=schedule,
        in_step_peak_bytes=in_step.peak_bytes,
        in_step_baseline_peak_bytes=in_step_baseline.peak_bytes,
        batch_stated=batch_stated and not batch_known,
        _model=None if batch_known else model,
    )

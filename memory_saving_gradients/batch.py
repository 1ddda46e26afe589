"""The batch as a variable: predicted peaks at any batch size, and the largest batch that fits.

Layer: analysis (read-only); imports: simulate (graph, schedule, _tensorflow for type
hints only).

A graph traced with an unknown batch dimension (``None``: ``tf.data`` without
``drop_remainder``, ``input_signature=[tf.TensorSpec([None, ...])]``, v1
placeholders) has no single size.  The memory model (:mod:`.simulate`) is
exact for any size it is given: :class:`PeakModel` evaluates it at the batch
asked (every unknown dimension counted as that batch, so a tensor with the
unknown dimension twice grows with its square, as it does when run), and
remembers what it found.  A peak never falls as the batch grows (every
buffer's size is non-decreasing in it), so the largest batch that fits a
memory is found by a search over integers.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Callable, Sequence

from . import simulate

if TYPE_CHECKING:
    from ._tensorflow import tf
    from .graph import ForwardRegion
    from .schedule import Schedule

#: The batch sizes a plan for an unknown batch is judged at (``strategies``): from
#: a small batch, where weights outweigh activations, to a large one, where the
#: activations, which checkpointing reduces, dominate.
PLANNING_BATCHES = (8, 64, 512, 4096)

#: What a largest batch leaves free, as a fraction of the predicted peak: the memory
#: model leaves out kernels' scratch space and what the executor's parallelism keeps
#: alive at once (docs/planner.md, "The largest batch that fits").
HEADROOM = 0.15

#: The largest batch :func:`largest_fitting` considers.
BATCH_LIMIT = 2**24


def checked_batch(batch) -> int:
    """``batch`` as an ``int``; ValueError unless it is a positive integer (a float such
    as 1.5 is no batch)."""
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
        raise ValueError(f"batch must be a positive integer; got {batch!r}.")
    return int(batch)


def checked_bytes(value, name: str, positive: bool = True) -> float:
    """``value`` as a number of bytes; ValueError unless it is a finite number, above 0
    (``positive``) or at least 0."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value < 0 or (positive and value == 0)):
        raise ValueError(
            f"{name} must be a {'positive' if positive else 'non-negative'}, finite number "
            f"of bytes; got {value!r} (e.g. 4 * 2**30 for 4 GiB).")
    return float(value)


class PeakModel:
    """Predicted peaks of a plan and of plain ``tf.gradients`` at any batch size.

    ``fetched``: the gradients of xs stay alive to the end of the step, as
    :class:`planning.Plan` reports them (see :func:`simulate.predict_baseline`);
    ``stops``: the ``stop_gradients``; ``schedule``: the plan's backward schedule,
    when already worked out (it is the same at every batch).
    """

    def __init__(self, region: ForwardRegion, ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
                 checkpoints: Sequence[tf.Tensor], fetched: bool = True,
                 stops: Sequence[tf.Tensor] = (), schedule: Schedule | None = None):
        self.region, self.ys, self.xs = region, list(ys), list(xs)
        self.checkpoints = list(checkpoints)
        self.fetched = fetched
        self.stops = list(stops)
        self.schedule = schedule
        self._peaks: dict = {}

    def peak_at(self, batch: int, plain: bool = False) -> int:
        """Predicted peak bytes at this batch: of the plan, or of plain ``tf.gradients``."""
        batch = checked_batch(batch)
        key = (batch, plain)
        if key not in self._peaks:
            sizer = simulate.Sizer(batch)
            baseline = simulate.predict_baseline(
                self.region, self.ys, self.xs, batch, self.fetched, sizer)
            self._peaks[(batch, True)] = baseline.peak_bytes
            if self.checkpoints:
                self._peaks[(batch, False)] = simulate.predict_checkpointed(
                    self.region, self.ys, self.xs, self.checkpoints, batch, self.fetched,
                    sizer, self.stops, self.schedule).peak_bytes
            else:  # nothing kept: plain tf.gradients
                self._peaks[(batch, False)] = baseline.peak_bytes
        return self._peaks[key]

    def largest_batch(self, memory_bytes: float, plain: bool = False, fixed_bytes: float = 0,
                      per_example_bytes: float = 0, headroom: float | None = None) -> int:
        """The largest batch whose predicted peak times ``1 + headroom`` (``HEADROOM``
        unless given), plus ``fixed_bytes + per_example_bytes * batch`` (what the step
        needs besides, e.g. weights and the input batch), fits ``memory_bytes``; 0 when
        not even a batch of one does."""
        scale = 1 + (HEADROOM if headroom is None else headroom)

        def need(batch):
            return scale * self.peak_at(batch, plain) + fixed_bytes + per_example_bytes * batch

        return largest_fitting(need, memory_bytes)


def largest_fitting(need: Callable[[int], float], memory: float,
                    limit: int = BATCH_LIMIT) -> int:
    """The largest batch ``b`` in [1, limit] with ``need(b) <= memory``, for ``need``
    non-decreasing in ``b``; 0 when ``need(1)`` does not fit.

    The first guess extrapolates the line through ``need(1)`` and ``need(64)``
    (exact where bytes are fixed + per example * batch); the search then
    gallops to bracket the answer and bisects, so it is exact either way.
    """
    if need(1) > memory:
        return 0
    low = 1
    slope = (need(64) - need(1)) / 63.0
    guess = limit if slope <= 0 else int((memory - need(1)) / slope) + 1
    guess = max(1, min(limit, guess))
    if need(guess) <= memory:
        low, step = guess, max(1, guess // 16)
        while low < limit:
            nxt = min(limit, low + step)
            if need(nxt) > memory:
                high = nxt
                break
            low, step = nxt, step * 2
        else:
            return limit
    else:
        high, step = guess, max(1, guess // 16)
        while True:
            nxt = max(1, high - step)
            if need(nxt) <= memory:
                low = nxt
                break
            high, step = nxt, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        if need(middle) <= memory:
            low = middle
        else:
            high = middle
    return low


def describe_range(batches: Sequence[int] = PLANNING_BATCHES) -> str:
    """``"8, 64, 512 and 4096"``."""
    names = [str(b) for b in batches]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]

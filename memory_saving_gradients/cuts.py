"""Where the forward pass can be cut: live sets along a topological order.

Layer: analysis (read-only); imports: graph (_tensorflow for type hints only).

Pure analysis, one sweep over the region's ops (linear in ops + edges): the
candidates that :mod:`.budget` chooses from.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import TYPE_CHECKING, Callable, NamedTuple

from .graph import ForwardRegion, NeedsGradient, gradient_reads, gradient_reads_output_of, tensor_order

if TYPE_CHECKING:
    from ._tensorflow import tf


@dataclasses.dataclass(frozen=True)
class Cuts:
    """Where the forward pass can be cut, along the region's topological order.

    After the op at ``positions[i]`` runs, the tensors ``tensors[i]`` are the
    ones still waiting for a later consumer: keeping them separates everything
    before from everything after.  ``output_bytes[p]`` and ``work[p]`` are
    prefix sums over the ops at positions <= p (what a segment allocates and
    computes), ``largest[p]`` the size of the op's largest output;
    ``held_bytes[p]`` counts only the outputs some gradient reads (they stay
    alive from the recomputation to the backward step; the others are freed
    as soon as their consumers have run).  A copy
    runs only if a gradient in its segment reads it or a copy that runs reads
    it (:func:`graph.copies_that_run`); ops no gradient ever reads are left
    out of the prefix sums, and ``pruned[i]`` lists the :class:`PrunedOp` of
    the ops that a segment ending at cut ``i`` would not run, sorted by
    position.
    """

    positions: tuple
    tensors: tuple
    new_bytes: tuple      # per cut: [(start position, bytes)] of its tensors, sorted by start
    output_bytes: tuple
    work: tuple
    largest: tuple
    pruned: tuple
    held_bytes: tuple


class PrunedOp(NamedTuple):
    """An op that a segment ending at some cut would not run."""

    position: int
    work: float
    bytes: int
    held_bytes: int


class _OpTable(NamedTuple):
    """Per op of the order: its outputs' bytes, and prefix sums over the ops a copy of
    which runs (see :class:`Cuts`)."""

    own_bytes: dict       # tensor ref -> bytes of its own (0 for an alias)
    starts: dict          # position -> its outputs that a later op reads
    output_prefix: list
    held_prefix: list
    work_prefix: list
    largest: list
    op_work: list
    op_bytes: list
    op_held: list


class _LiveSet(NamedTuple):
    """The tensors live after the op at ``position``, and their bytes."""

    position: int
    bytes: int
    tensors: tuple


def live_cuts(region: ForwardRegion, size: Callable[[tf.Tensor], int],
              cost: Callable[[tf.Operation], float],
              aliases: Callable[[tf.Operation], bool] = lambda op: False,
              max_cuts: int = 300, needs_gradient: NeedsGradient = lambda tensor: True) -> Cuts:
    """The cuts of the region, in one sweep over its ops (linear in ops + edges).

    Consecutive positions whose live sets differ only in tensors of no bytes of
    their own (variable reads, aliases) give one cut; when there are
    more than ``max_cuts``, the cheapest cut of each of ``max_cuts`` equal
    stretches of the order is kept.  ``size(t)`` and ``cost(op)`` give bytes
    and work; outputs of ops for which ``aliases(op)`` share their input's buffer and
    cost nothing of their own.  ``needs_gradient(tensor)``: whether an input's
    gradient is wanted (see :func:`graph.gradient_reads`).
    """
    order = region.order
    position = {op: i for i, op in enumerate(order)}
    end_of = _last_reads(order, position, aliases)
    first_read = _first_reads(order, position, needs_gradient, region.receives_gradient)
    table = _op_table(order, position, size, cost, aliases, end_of, first_read,
                      region.receives_gradient)
    live_sets = _thinned(_live_sets(len(order), table, end_of), max_cuts)
    positions = tuple(c.position for c in live_sets)
    tensors = tuple(tuple(sorted(c.tensors, key=tensor_order)) for c in live_sets)
    new_bytes = tuple(
        tuple(sorted((position[t.op], table.own_bytes[t.ref()]) for t in ts)) for ts in tensors
    )
    pruned = _pruned_at(positions, first_read, table.op_work, table.op_bytes, table.op_held)
    return Cuts(positions, tensors, new_bytes, tuple(table.output_prefix),
                tuple(table.work_prefix), tuple(table.largest), pruned,
                tuple(table.held_prefix))


def _last_reads(order, position, aliases) -> dict:
    """Per output (by ref): the last position that reads it, or reads an alias of it
    (its own position if none does).  One reverse sweep."""
    end_of: dict = {}
    for op in reversed(order):
        for t in op.outputs:
            ends = [position[c] for c in t.consumers() if c in position]
            end = max(ends, default=position[op])
            end = max(end, end_of.get(t.ref(), end))
            end_of[t.ref()] = end
            if aliases(op) and op.inputs and op.inputs[0].op in position:
                source = op.inputs[0].ref()
                end_of[source] = max(end_of.get(source, 0), end)
    return end_of


def _op_table(order, position, size, cost, aliases, end_of, first_read,
              receives_gradient=lambda op: True) -> _OpTable:
    """Bytes, work and prefix sums per op; ops whose copy never runs
    (``first_read`` inf) stay out of the prefix sums."""
    table = _OpTable({}, {}, [], [], [], [], [], [], [])
    total_bytes = total_work = total_held = 0
    for i, op in enumerate(order):
        own = held = big = 0
        read = _outputs_gradients_read(op, position, receives_gradient)
        for t in op.outputs:
            nbytes = 0 if aliases(op) else size(t)
            table.own_bytes[t.ref()] = nbytes
            own += nbytes
            if t.ref() in read:
                held += nbytes
            big = max(big, nbytes)
            if end_of[t.ref()] > i:
                table.starts.setdefault(i, []).append(t)
        work = cost(op)
        table.op_work.append(work)
        table.op_bytes.append(own)
        table.op_held.append(held)
        if first_read[i] < math.inf:  # else no copy of it ever runs
            total_bytes += own
            total_held += held
            total_work += work
        table.output_prefix.append(total_bytes)
        table.held_prefix.append(total_held)
        table.work_prefix.append(total_work)
        table.largest.append(big)
    return table


def _live_sets(n_ops: int, table: _OpTable, end_of: dict) -> list:
    """The live set after each position where the set changes next (a sweep)."""
    starts, own_bytes = table.starts, table.own_bytes
    ending: dict = {}
    for ts in starts.values():
        for t in ts:
            ending.setdefault(end_of[t.ref()], []).append(t)
    live: dict = {}
    live_bytes = 0
    found = []
    for i in range(n_ops - 1):
        for t in ending.get(i, ()):
            live_bytes -= own_bytes[t.ref()]
            live.pop(t.ref(), None)
        for t in starts.get(i, ()):
            live[t.ref()] = t
            live_bytes += own_bytes[t.ref()]
        # a change of zero-byte tensors only (variable reads, aliases) makes no new
        # cut: it would only crowd the real ones out of the max_cuts kept
        changes_next = any(own_bytes[t.ref()] for t in ending.get(i + 1, ())) or any(
            own_bytes[t.ref()] for t in starts.get(i + 1, ()))
        if changes_next and live:
            found.append(_LiveSet(i, live_bytes, tuple(live.values())))
    return found


def _thinned(live_sets: list, max_cuts: int) -> list:
    """At most ``max_cuts``: the cheapest (latest among equals) of each of
    ``max_cuts`` equal stretches."""
    if len(live_sets) <= max_cuts:
        return live_sets
    chosen = []
    stretch = len(live_sets) / max_cuts
    for b in range(max_cuts):
        lo, hi = int(b * stretch), int((b + 1) * stretch)
        if hi > lo:
            chosen.append(min(live_sets[lo:hi], key=lambda c: (c.bytes, -c.position)))
    return chosen


def _outputs_gradients_read(op, position, receives_gradient=lambda op: True) -> set:
    """Refs of the outputs of ``op`` that its own gradient or a consumer's reads.

    A tensor whose shape is only known at run time is not counted as read for that
    alone: counting it makes every tensor of an unknown-batch graph "held", and its
    plans peak 39% above the known-batch graph's (transformer, batch 64, predicted);
    the simulation, which has the last word, judges each plan either way."""
    read = {t.ref() for t in gradient_reads(op)[1]} if receives_gradient(op) else set()
    for t in op.outputs:
        if t.ref() in read:
            continue
        if any(
            c in position and receives_gradient(c)
            and t.ref() in {r.ref() for r in gradient_reads(c)[0]}
            for c in t.consumers()
        ):
            read.add(t.ref())
    return read


def _first_reads(order, position, needs_gradient=lambda tensor: True,
                 receives_gradient=lambda op: True) -> list:
    """Per op: the first position at which a gradient reads it or what it feeds.

    A segment ending before that position never runs the op's copy; ``inf``:
    no segment does.  One reverse sweep, linear in ops + edges.
    """
    first = [math.inf] * len(order)
    for i in range(len(order) - 1, -1, -1):
        op = order[i]
        best = i if receives_gradient(op) and gradient_reads(op)[1] else math.inf
        for t in op.outputs:
            for c in t.consumers():
                j = position.get(c)
                if j is not None:
                    best = min(best, j if receives_gradient(c) and gradient_reads_output_of(
                        op, c, needs_gradient) else first[j])
        first[i] = best
    return first


def _pruned_at(positions, first_read, op_work, op_bytes, op_held) -> tuple:
    """Per cut: the ops at or before it whose first read comes after it."""
    pruned = []
    waiting: list = []
    next_op = 0
    for p in positions:
        while next_op <= p:
            if first_read[next_op] < math.inf:
                heapq.heappush(waiting, (first_read[next_op], next_op))
            next_op += 1
        while waiting and waiting[0][0] <= p:
            heapq.heappop(waiting)
        pruned.append(tuple(sorted(
            PrunedOp(i, op_work[i], op_bytes[i], op_held[i]) for _, i in waiting
        )))
    return tuple(pruned)

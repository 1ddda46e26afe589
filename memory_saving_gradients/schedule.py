"""The backward schedule: which groups the backward pass differentiates, in which order, and how.

Layer: analysis (read-only); imports: graph, _tensorflow.

Pure: a function of the forward region, the tensors kept from the forward
pass and the ``stop_gradients``; nothing is built.  The memory model
(:func:`.simulate.predict_checkpointed`) and the rewrite
(:func:`.checkpointing.gradients`) both walk the list of :class:`Step` s it
returns, so that ``plan()`` predicts the backward pass ``gradients()`` builds;
nothing else decides the order.

Each step differentiates one group of producers of kept tensors (see
:func:`.graph.backward_groups`, which orders them), in one of three ways:

- ``RECOMPUTED``: the segment's ops are copied from its kept inputs and the
  copies differentiated, after the gradients of its targets are complete;
- ``IN_PLACE``: one op, its registered gradient called on the forward op;
- ``WHOLE``: ``tf.gradients`` from the targets to the segment's kept inputs,
  without copies: a v1 ``while_loop``/``cond`` construct (its last op stands for
  it, and its inner tensors are never targets), or an op TensorFlow's own
  machinery must differentiate (a function call, v2 control flow).

The gradient of a ``stop_gradients`` tensor's op is never taken: such ops are
kept out of merged groups and have no step.  Which of a step's targets get a
gradient is known only while the pass runs (a step without any is skipped).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import Sequence

from . import graph as graph_lib
from ._tensorflow import tf

RECOMPUTED = "recomputed"
IN_PLACE = "in place"
WHOLE = "whole"


@dataclasses.dataclass(frozen=True)
class Step:
    """One group of the backward pass, in the schedule's order.

    Attributes:
      index: the step's place in the schedule (names its ops ``recompute_<index>``,
        ``backprop_<index>``).
      group: the producers of kept tensors it differentiates (a v1 construct: its last op).
      members: those ops, each v1 construct expanded to all its ops.
      segment: the ops between its targets and the kept tensors they depend on.
      handling: ``RECOMPUTED``, ``IN_PLACE`` or ``WHOLE`` (see the module docstring).
      targets: the kept outputs of its members; those with a gradient when the step
        runs are differentiated.
      inputs: the tensors it computes gradients for (empty: it computes none).
    """

    index: int
    group: tuple
    members: tuple
    segment: graph_lib.Segment
    handling: str
    targets: tuple
    inputs: tuple

    @functools.cached_property
    def trainable_inputs(self) -> tuple:
        """For ``RECOMPUTED``, the segment's inputs that carry a gradient (the copies
        read them through proxies); else ``inputs``."""
        if self.handling != RECOMPUTED:
            return self.inputs
        # variants too: a loop hands its TensorArrays/TensorLists out through them
        return tuple(t for t in self.segment.inputs if graph_lib.carries_gradient(t))

    @property
    def op(self) -> tf.Operation:
        """The group's latest op (a v1 construct's last op)."""
        return self.group[-1]

    def describe(self) -> tuple:
        """The step by names: ``(group, handling, segment ops, inputs)``, for comparisons."""
        return (
            tuple(op.name for op in self.group), self.handling,
            tuple(op.name for op in self.segment.ops), tuple(t.name for t in self.inputs),
        )


@dataclasses.dataclass(frozen=True)
class RegionFacts:
    """What the schedule needs of a region and its xs, whatever the checkpoints.

    Attributes:
      constructs: the region's v1 control-flow constructs (:func:`.graph.control_flow_constructs`).
      carriers: refs of the tensors whose gradient can reach an x (:func:`.graph.gradient_carriers`).
    """

    constructs: dict
    carriers: frozenset


_facts_lock = threading.Lock()
_facts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # region -> {xs: facts}


def region_facts(region: graph_lib.ForwardRegion, xs: Sequence[tf.Tensor]) -> RegionFacts:
    """The :class:`RegionFacts` of ``region`` and ``xs`` (linear in the region), worked
    out once per region object: the strategy, the plan and the rewrite of one call
    share them."""
    key = tuple(x.ref() for x in xs)
    with _facts_lock:
        found = _facts.get(region, {}).get(key)
    if found is None:
        found = RegionFacts(
            constructs=graph_lib.control_flow_constructs(region),
            carriers=graph_lib.gradient_carriers(
                region, xs, graph_lib.blocks_gradients, graph_lib.carries_gradient),
        )
        with _facts_lock:
            _facts.setdefault(region, {})[key] = found
    return found


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The backward pass's steps, and what they were worked out from.

    Attributes:
      kept: the tensors kept from the forward pass, by ``ref()`` (:func:`.graph.boundary_tensors`).
      read_kept: refs of the kept tensors that their producer's gradient reads, not a
        copy (:func:`.graph.kept_read_by_gradients`).
      carriers: refs of the tensors whose gradient can reach an x.
      stop_ops: the ops of ``stop_gradients``.
      steps: the :class:`Step` s, in the order the backward pass takes them.
    """

    kept: dict
    carriers: frozenset
    stop_ops: frozenset
    steps: tuple
    read_kept: frozenset = frozenset()

    def describe(self) -> tuple:
        """Every step by names (:meth:`Step.describe`), for comparisons."""
        return tuple(step.describe() for step in self.steps)


def backward_schedule(
    region: graph_lib.ForwardRegion,
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    checkpoints: Sequence[tf.Tensor],
    stops: Sequence[tf.Tensor] = (),
    facts: RegionFacts | None = None,
) -> Schedule:
    """The backward schedule of ``gradients(ys, xs, checkpoints=checkpoints,
    stop_gradients=stops)`` over ``region``; ``facts``: :func:`region_facts`, when
    already known.  Linear in the segments' sizes (times a log for the order)."""
    facts = facts or region_facts(region, xs)
    kept = graph_lib.boundary_tensors(region, ys, xs, checkpoints)
    stop_ops = frozenset(t.op for t in stops)
    constructs = facts.constructs
    producers = {
        constructs[t.op][-1] if t.op in constructs else t.op
        for t in kept.values() if t.op in region
    }
    groups = graph_lib.backward_groups(
        region, kept, producers,
        isolated=frozenset(op for op in producers if op in constructs or op in stop_ops),
        results=frozenset(x.ref() for x in xs),
    )
    steps = tuple(
        _step(index, group, segment, kept, facts)
        for index, (group, segment) in enumerate(groups)
        if group[-1] not in stop_ops
    )
    return Schedule(kept=kept, carriers=facts.carriers, stop_ops=stop_ops, steps=steps,
                    read_kept=graph_lib.kept_read_by_gradients(region, kept, xs))


def _step(index: int, group: tuple, segment, kept: dict, facts: RegionFacts) -> Step:
    """How one group of :func:`.graph.backward_groups` is differentiated."""
    op = group[-1]
    members = tuple(m for g in group for m in facts.constructs.get(g, (g,)))
    targets = tuple(t for member in members for t in member.outputs if t.ref() in kept)
    if op in facts.constructs:
        segment = graph_lib.construct_segment(members, targets, kept)
    carried = tuple(t for t in segment.inputs if t.ref() in facts.carriers)
    if segment.recompute:
        inputs = tuple(t for t in carried if graph_lib.carries_gradient(t))
        return Step(index, group, members, segment, RECOMPUTED, targets, inputs)
    if graph_lib.is_differentiable_in_place(op):
        return Step(index, group, members, segment, IN_PLACE, targets, tuple(op.inputs))
    return Step(index, group, members, segment, WHOLE, targets, carried)

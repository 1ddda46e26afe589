"""The guard: ``gradients()`` never returns a structure ``tf.gradients`` would not.

Layer: transform; imports: graph, notices, ops, rewrite, _tensorflow.

While the rewrite builds the backward pass, :func:`rewrite.observed_gradient_calls`
notes which ops' gradient functions TensorFlow ran and with what kinds of
gradients (none, ``IndexedSlices``, dense).  Afterwards one walk over the ops
between ``xs`` and ``ys`` replays ``tf.gradients``' own rules
(``gradients_util``): the ops it reaches from ``xs`` through trainable tensors
(``backprop_util.IsTrainable``: float, complex, resource, variant), those of
them on a path to ``ys``, its stop ops (``stop_gradients``, and ``xs`` whose
op has no input on such a path), the zeros it gives unused trainable outputs
of the ops it differentiates, and its sums (``IndexedSlices`` only, or else
dense).  Where an op's gradient function ran, its input gradients are taken
from that run; elsewhere a small rule stands in (identity-like gradients pass
the kind on, gathers give ``IndexedSlices``, others dense).

A difference is: an op on a gradient path to an x (not behind a
``StopGradient``) that ``tf.gradients`` would differentiate but the rewrite
did not, or did with other kinds of output gradients, or the other way round;
or an x whose gradient is missing, extra, or of another kind.  The walk is
linear in the ops and edges between ``xs`` and ``ys``; it builds nothing.
Ops inside v1 control flow are differentiated by ``tf.gradients`` as a whole
construct: only their result is compared.
"""

from __future__ import annotations

import heapq
import logging
from typing import Callable, Sequence

from . import _tensorflow as _tf_internals
from . import graph as graph_lib
from . import notices, rewrite
from . import ops as op_types
from ._tensorflow import tf
from .notices import FallbackWarning

logger = logging.getLogger("memory_saving_gradients")

_ORDER = {kind: i for i, kind in enumerate(rewrite.KIND_ORDER)}


def _join(a: str, b: str) -> str:
    return a if _ORDER[a] >= _ORDER[b] else b


def guarded_gradients(
    build: Callable[[], list],
    fallback: Callable[[], list],
    graph: tf.Graph,
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    grad_ys: Sequence[tf.Tensor | None],
    stops: Sequence[tf.Tensor],
    unconnected: tf.UnconnectedGradients | str,
) -> list:
    """``build()``'s gradients if their structure is ``tf.gradients``', else ``fallback()``'s.

    An exception inside ``build`` falls back too, unless ``fallback`` raises
    as well (then the error is the user's, and ``build``'s error is raised).
    Each fallback warns once (:class:`FallbackWarning`, and the logger).
    """
    failure = None
    with rewrite.observed_gradient_calls(graph) as calls:
        try:
            results = build()
        except Exception as error:
            failure = error
    if failure is not None:
        try:
            plain = fallback()
        except Exception:
            raise failure from None
        _warn(f"the rewrite raised {type(failure).__name__}: {str(failure)[:300]}"
              f"{_raised_at(failure)}")
        return plain
    try:
        difference = find_difference(ys, xs, grad_ys, stops, unconnected, results, calls.calls)
    except Exception as error:
        difference = f"the check itself failed ({type(error).__name__}: {error})"
    if difference is None:
        return results
    _warn(difference)
    return fallback()


def _raised_at(error: BaseException) -> str:
    """`` (in file:line, function)`` of the innermost frame of this package that raised."""
    import os
    import traceback

    package = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if os.path.abspath(f.filename).startswith(package)]
    if not frames:
        return ""
    last = frames[-1]
    return f" (in {os.path.basename(last.filename)}:{last.lineno}, {last.name})"


def _warn(reason: str) -> None:
    message = (
        f"{reason}. This call uses plain tf.gradients instead "
        "(no memory saved for it); please report this with the model."
    )
    logger.warning("%s", message)  # the logger's filter begins it with the library's name
    notices.warn(notices.LOG_PREFIX + message, FallbackWarning)


def find_difference(
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    grad_ys: Sequence[tf.Tensor | None],
    stops: Sequence[tf.Tensor],
    unconnected: tf.UnconnectedGradients | str,
    results: Sequence[rewrite.Gradient],
    calls: dict,
) -> str | None:
    """How the rewrite's gradients (``results``, built with gradient function runs
    ``calls``) differ in structure from what ``tf.gradients`` gives, or None."""
    walk = _Walk(ys, xs, grad_ys, stops, calls)
    differing = walk.differing_ops()
    zero = tf.UnconnectedGradients(unconnected) == tf.UnconnectedGradients.ZERO
    for x, got in zip(xs, results):
        expected = walk.x_kind(x, zero)
        kind = rewrite.gradient_kind(got)
        if kind != expected:
            culprit = walk.last_on_path(x, differing)
            if culprit is not None:
                where = f"; on its path the backward pass first differs at {_describe(culprit, differing)}"
            else:  # each op on the path was right: the sum at x went wrong
                sources = [op for op in x.consumers() if walk.differentiated_by_tf(op)]
                where = "; the gradients summed for it come from " + (", ".join(
                    f"op {op.name!r} (type {op.type})" for op in sources[:3]) or "no op")
            return (f"the rewritten backward pass gives {_kind_words(kind)} for {x.name} where "
                    f"tf.gradients gives {_kind_words(expected)}{where}")
    if differing:
        op = max(differing, key=graph_lib.op_order)
        return f"the rewrite treated {_describe(op, differing)}"
    return None


def _kind_words(kind: str) -> str:
    return {"none": "no gradient", "sparse": "an IndexedSlices", "dense": "a dense gradient"}[kind]


def _describe(op: tf.Operation, differing: dict) -> str:
    return f"op {op.name!r} (type {op.type}): {differing[op]}"


class _Walk:
    """``tf.gradients``' view of the graph between ``xs`` and ``ys``, replayed."""

    def __init__(self, ys, xs, grad_ys, stops, calls: dict):
        self.calls = calls
        self.xs = list(xs)
        self.reached = graph_lib.reached_by_tf_gradients(self.xs)
        self.between = self._between(ys)
        self.stop_gradient_ops = {t.op for t in stops}
        self.stop_ops = self.stop_gradient_ops | {
            x.op for x in xs
            if not any(t.op in self.between for t in x.op.inputs)
        }
        self.kinds: dict = {}
        for y, g in zip(ys, grad_ys):
            given = "dense" if g is None else rewrite.gradient_kind(g)
            self.kinds[y.ref()] = _join(self.kinds.get(y.ref(), "none"), given)
        self._propagate()

    def _between(self, ys) -> set:
        between: set = set()
        stack = [y.op for y in ys]
        while stack:
            op = stack.pop()
            if op in between or op not in self.reached:
                continue
            between.add(op)
            stack.extend(t.op for t in op.inputs)
        return between

    def received(self, t: tf.Tensor) -> str:
        return self.kinds.get(t.ref(), "none")

    def output_kinds(self, op: tf.Operation) -> tuple:
        """The kinds of ``op``'s output gradients as its gradient function gets them:
        zeros for unused trainable outputs."""
        return tuple(
            "dense" if k == "none" and _zero_filled(t) else k
            for t, k in ((t, self.received(t)) for t in op.outputs)
        )

    def differentiated_by_tf(self, op: tf.Operation) -> bool:
        if op not in self.between or op in self.stop_ops:
            return False
        if not any(self.received(t) != "none" for t in op.outputs):
            return False
        try:
            return rewrite.original_gradient_function(op) is not None
        except LookupError:
            return _tf_internals.is_function_call(op)

    def _propagate(self) -> None:
        """Input gradient kinds of every op, consumers before producers (again where
        a v1 loop's back edge raises a kind that was already passed on)."""
        heap = [(-graph_lib.op_order(op), i, op) for i, op in enumerate(self.between)]
        heapq.heapify(heap)
        queued = set(self.between)
        counter = len(heap)
        while heap:
            _, _, op = heapq.heappop(heap)
            queued.discard(op)
            if not self.differentiated_by_tf(op):
                continue
            for t, kind in zip(op.inputs, self._input_kinds(op)):
                if kind == "none":
                    continue
                old = self.received(t)
                new = _join(old, kind)
                if new != old:
                    self.kinds[t.ref()] = new
                    if t.op in self.between and t.op not in queued:
                        counter += 1
                        queued.add(t.op)
                        heapq.heappush(heap, (-graph_lib.op_order(t.op), counter, t.op))

    def _input_kinds(self, op: tf.Operation) -> tuple:
        seen = self.calls.get(op)
        if seen is not None:
            # TensorFlow's gradient of a v2 loop or cond adds inputs and outputs
            # (accumulators) to the op after its gradient function ran
            return tuple(seen[1]) + ("none",) * (len(op.inputs) - len(seen[1]))
        return _static_input_kinds(op, self.output_kinds(op))

    def differing_ops(self) -> dict:
        """``{op: reason}`` for the ops on a gradient path to an x that the rewrite
        differentiated otherwise than ``tf.gradients`` would."""
        differing: dict = {}
        for op in self._on_gradient_paths():
            if _in_v1_control_flow(op):
                continue
            try:
                if rewrite.original_gradient_function(op) is None:
                    continue
            except LookupError:
                continue
            expected = self.differentiated_by_tf(op)
            seen = self.calls.get(op)
            if expected and seen is None:
                differing[op] = ("tf.gradients differentiates it (output gradients "
                                 f"{list(self.output_kinds(op))}), the rewrite did not")
            elif seen is not None and not expected:
                differing[op] = "the rewrite differentiated it, tf.gradients does not"
            elif seen is not None and tuple(seen[0]) != self.output_kinds(op)[:len(seen[0])]:
                differing[op] = (f"its gradient function got output gradients {list(seen[0])} "
                                 f"where tf.gradients gives {list(self.output_kinds(op))}")
        return differing

    def _on_gradient_paths(self) -> list:
        """Ops between xs and ys that read a tensor whose gradient can reach an x:
        forward from xs through ops that pass gradients on."""
        live = {x.ref() for x in self.xs}
        stack = list(self.xs)
        ops: dict = {}
        while stack:
            for op in stack.pop().consumers():
                if op in ops or op not in self.between or op in self.stop_gradient_ops:
                    continue
                ops[op] = None
                if graph_lib.blocks_gradients(op):
                    continue
                for t in op.outputs:
                    if graph_lib.carries_gradient(t) and t.ref() not in live:
                        live.add(t.ref())
                        stack.append(t)
        return list(ops)

    def last_on_path(self, x: tf.Tensor, differing: dict):
        """The op of ``differing`` reachable from ``x`` along gradient paths that the
        backward pass reaches first (the latest in topological order)."""
        found = None
        seen: set = set()
        stack = [x]
        while stack:
            for op in stack.pop().consumers():
                if op in seen or op not in self.between:
                    continue
                seen.add(op)
                if op in differing and (found is None or
                                        graph_lib.op_order(op) > graph_lib.op_order(found)):
                    found = op
                stack.extend(t for t in op.outputs if graph_lib.carries_gradient(t))
        return found

    def x_kind(self, x: tf.Tensor, zero: bool) -> str:
        """The kind of gradient ``tf.gradients`` returns for ``x``."""
        kind = self.received(x)
        if kind == "none" and self.differentiated_by_tf(x.op) and _zero_filled(x):
            kind = "dense"  # an unused output of an op it differentiates: zeros
        if kind == "none" and zero:
            kind = "dense"
        return kind


def _zero_filled(t: tf.Tensor) -> bool:
    """Whether ``tf.gradients`` passes zeros for output ``t`` when no gradient reaches it."""
    return graph_lib.carries_gradient(t) and _tf_internals.supports_default_grad(t)


def _in_v1_control_flow(op: tf.Operation) -> bool:
    return (graph_lib.v1_control_flow_context(op) is not None
            or op.type in op_types.V1_CONTROL_FLOW)


def _static_input_kinds(op: tf.Operation, outputs: tuple) -> tuple:
    """Input gradient kinds of an op whose gradient function did not run in the rewrite
    (only after a difference): identity-like gradients pass their output's kind on,
    gathers give ``IndexedSlices`` for their params, others dense."""
    try:
        function = rewrite.original_gradient_function(op)
    except LookupError:
        function = None if not _tf_internals.is_function_call(op) else "call"
    if function is None:
        return ("none",) * len(op.inputs)
    passes = {_tf_internals.registered_gradient(t) for t in op_types.GRADIENT_PASSES_KIND} - {None}
    gathers = {_tf_internals.registered_gradient(t) for t in op_types.GATHERS} - {None}
    kinds = []
    for i, t in enumerate(op.inputs):
        if not graph_lib.carries_gradient(t):
            kinds.append("none")
        elif function in passes:
            kinds.append(outputs[i] if len(outputs) == len(op.inputs) else outputs[0])
        elif function in gathers and i == 0:
            kinds.append("sparse" if graph_lib.gathers_rows(op) else "dense")
        else:
            kinds.append("dense")
    return tuple(kinds)


__all__ = ["guarded_gradients", "find_difference"]

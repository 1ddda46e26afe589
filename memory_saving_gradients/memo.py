"""Plans remembered by the structure of the graph they were made for.

Layer: analysis (read-only); imports: graph, _tensorflow (planning, schedule for type
hints only).

Keras and ``tf.function`` trace the same step again and again (a second
``fit``, a new ``train_function``, a retrace for another input signature
that happens to give the same shapes).  Each trace is a new graph, but the
planner's answer depends only on the forward region's structure: op types,
edges, shapes and dtypes, and which tensors are ``ys`` and ``xs``.  A
fingerprint of that structure (linear in ops + edges, much cheaper than
planning) keys the chosen checkpoints, stored as positions in the region's
topological order, so that an identical retrace is not planned again.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from ._tensorflow import tf
from .graph import ForwardRegion, loop_accumulators

if TYPE_CHECKING:
    from .planning import Plan
    from .schedule import Schedule

#: How many plans are remembered (least recently used go first).
CAPACITY = 128

_lock = threading.Lock()
_plans: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_figures: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()


def fingerprint(region: ForwardRegion, ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
                outside: tuple = ()) -> str:
    """A digest of the region's structure, the same for identical retraces;
    ``outside``: what the memory model estimates of the tensors the region reads from
    outside it (:func:`.simulate.outside_estimates`), which the region's ops do not
    show."""
    position = {op: i for i, op in enumerate(region.order)}
    x_index = {x.ref(): i for i, x in enumerate(xs)}
    digest = hashlib.sha1()

    def describe(tensor) -> str:
        at = position.get(tensor.op)
        if at is not None:
            return f"{at}:{tensor.value_index}"
        x = x_index.get(tensor.ref())
        kind = f"x{x}" if x is not None else tensor.op.type
        return f"<{kind} {tensor.dtype.name} {tensor.shape}>"

    for op in region.order:
        inputs = ",".join(describe(t) for t in op.inputs)
        outputs = ",".join(f"{t.dtype.name}{t.shape}" for t in op.outputs)
        digest.update(f"{op.type}({inputs})->{outputs}{_loop_signature(op)};".encode())
    digest.update(("ys:" + ",".join(describe(y) for y in ys)).encode())
    digest.update(("xs:" + ",".join(describe(x) for x in xs)).encode())
    digest.update(f"outside:{outside!r}".encode())
    return digest.hexdigest()


def _loop_signature(op: tf.Operation) -> str:
    """What a v2 while loop keeps for its gradient and how often (its trip count): sizes
    the loop's outputs do not show (a loop bounded by 6 and one bounded by 24 have the
    same outputs); empty for any other op."""
    kept = loop_accumulators(op)
    if kept is None:
        return ""
    tensors = ",".join(f"{t.dtype.name}{t.shape}" for t in kept.per_step + kept.zeros_per_step)
    return f"[{kept.steps}x{len(kept.per_step)}:{tensors}]"


def remembered(key: tuple, region: ForwardRegion, choose: Callable[[], list]) -> list:
    """``choose()``'s tensors, from memory when ``key`` was planned before.

    ``key`` must include :func:`fingerprint`; tensors outside the region are
    not remembered (the call is planned again).
    """
    with _lock:
        found = _plans.get(key)
        if found is not None:
            _plans.move_to_end(key)
    if found is not None:
        return [region.order[i].outputs[j] for i, j in found]
    tensors = choose()
    position = {op: i for i, op in enumerate(region.order)}
    if all(t.op in position for t in tensors):
        with _lock:
            _plans[key] = tuple((position[t.op], t.value_index) for t in tensors)
            while len(_plans) > CAPACITY:
                _plans.popitem(last=False)
    return tensors


def remembered_plan(key: tuple, checkpoints: Sequence[tf.Tensor], make: Callable[[], Plan],
                    schedule: Schedule | None = None) -> Plan:
    """``make()``'s :class:`~.planning.Plan` for ``checkpoints``, its figures from
    memory when ``key`` (as for :func:`remembered`) was described before; a
    remembered plan gets ``schedule`` (graph objects are not remembered)."""
    with _lock:
        found = _figures.get(key)
        if found is not None:
            _figures.move_to_end(key)
    if found is None:
        made = make()
        with _lock:
            _figures[key] = dataclasses.replace(made, checkpoints=(), schedule=None)
            while len(_figures) > CAPACITY:
                _figures.popitem(last=False)
        return made
    return dataclasses.replace(found, checkpoints=tuple(checkpoints), schedule=schedule)


def forget() -> None:
    """Drop every remembered plan."""
    with _lock:
        _plans.clear()
        _figures.clear()

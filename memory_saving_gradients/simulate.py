"""Static memory model: the predicted peak of a backward pass, before anything runs.

Layer: analysis (read-only); imports: graph, ops, schedule, shape_values, timing, workspace,
_tensorflow.

The model replays the step as TensorFlow's executor would run it one op at a
time: the forward pass in topological order, then (plain ``tf.gradients``)
every op's gradient in reverse order, or (checkpointed) each segment's
recomputation followed by its gradients.  Every tensor is a buffer that lives
from the step that makes it to the last step that reads it; what gradients
read of the forward pass comes from :func:`graph.gradient_reads`.  Ops that
only forward their input's buffer (reshapes, identities, variable reads)
allocate nothing.  Tensors fed from outside the region (placeholders,
constants, variables, a dataset's elements) are not counted: TensorFlow does
not allocate them in the step.  Those the step computes outside the region
(a dropout's mask, a rescaled input: :attr:`graph.ForwardRegion.computed_outside`)
are counted from the step's start, where the executor runs them, to their
last read; what they are made from, briefly live then, is not.

Sizes come from static shapes; an unknown dimension counts as
``unknown_dim`` and the prediction lists it among its assumptions.
A kernel's workspace counts at its step where :mod:`.workspace` knows it (an
einsum's transposed copies of its operands and product, a oneDNN max pool's
positions); others (convolution scratch without oneDNN) and the parallelism of
the executor are not modelled; the slack this leaves is measured in the tests.
Where the rewrite lets the executor run a gradient later than this order
(:func:`step_order`), the model counts what it reads as held until the latest
point the rewrite allows, and allows it only under the peak.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import re
import weakref
from typing import Callable, Hashable, Sequence, TypeVar

import numpy as np

from . import graph as graph_lib
from . import ops as op_types
from . import schedule as schedule_lib
from . import shape_values, step_time, timing, workspace
from ._tensorflow import tf

_T = TypeVar("_T")

_END = float("inf")

#: :data:`.ops.SAME_ELEMENTS`: outputs that hold exactly their first input's elements.
_SAME_ELEMENTS_OP_TYPES = op_types.SAME_ELEMENTS

#: Ops whose input's gradient takes the buffer of their output's (written into it, or it).
_GRADIENT_TAKES_INCOMING_BUFFER = (op_types.GRADIENT_WRITES_INTO_INCOMING
                                   | op_types.GRADIENT_IS_INCOMING)

#: Ops whose output is a part of their first input, dimension by dimension.
_SLICES = frozenset({"Slice", "StridedSlice"})


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A predicted peak, in bytes, and what it assumed."""

    peak_bytes: int
    forward_work: float  # the planner's cost (:meth:`Sizer.cost`) of every op of the region
    assumptions: tuple = ()
    recomputed_ops: tuple = ()  # (op type, how many copies of that type run), by count
    # the time model's seconds (:mod:`.timing`): the forward pass, the gradients, the copies
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    recompute_seconds: float = 0.0
    # the gradients of ops that more than one step differentiates, beyond the first time
    repeated_backward_seconds: float = 0.0
    # every kernel's seconds with the cache term (:func:`timed_seconds`; 0: not asked for)
    timed_seconds: float = 0.0

    @property
    def recompute_work(self) -> float:
        """What the plan adds to the step in the planner's cost (the time model's
        seconds): the copies, and the gradients taken again where two steps'
        segments share ops (groups that could not be merged, as on an unrolled LSTM
        whose kept tensors cut one of its two state paths but not the other)."""
        return self.recompute_seconds + self.repeated_backward_seconds

    @property
    def recompute_cost(self) -> float:
        """:attr:`recompute_work` as a fraction of one forward pass's seconds."""
        return self.recompute_work / self.forward_work if self.forward_work else 0.0

    @property
    def step_time_ratio(self) -> float:
        """Predicted time of the region's forward and backward pass with the recomputation,
        over the time without it."""
        plain = self.forward_seconds + self.backward_seconds
        return (plain + self.recompute_work) / plain if plain else 1.0


#: Ops whose output dimensions are the value of one of their inputs (its index): a
#: reshape's target, a fill's dimensions, a broadcast's shape.
_SHAPE_INPUT = {"Reshape": 1, "Fill": 0, "BroadcastTo": 1}

#: Ops that move spatial blocks into the batch (True) or back (False), and the index of
#: their block shape input (None: a ``block_size`` attribute, squared).
_BATCH_FACTOR = {"SpaceToBatchND": (True, 1), "BatchToSpaceND": (False, 1),
                 "SpaceToBatch": (True, None), "BatchToSpace": (False, None)}

#: Matrix products, and the names of the attributes that transpose their two operands.
_PRODUCTS = {"MatMul": ("transpose_a", "transpose_b"),
             "BatchMatMul": ("adj_x", "adj_y"), "BatchMatMulV2": ("adj_x", "adj_y"),
             "BatchMatMulV3": ("adj_x", "adj_y")}

#: Ops whose output has as many rows as their input has true (nonzero) elements, or
#: distinct ones, known only when they run: at most the input's element count (the rows
#: before the first dimension of a dynamic partition's data not in its partitions).
_DATA_BOUNDED = frozenset({"Where", "Unique", "UniqueWithCounts", "DynamicPartition"})

#: Ops that can make a dimension larger than their input's: a concat along its axis, a
#: tile, a pad.  Their unknown dimensions are worked out (:meth:`Sizer._grown_shape`),
#: never lent from an input.
_GROWING = frozenset({"ConcatV2", "Tile", "Pad", "PadV2", "MirrorPad"})

#: Gathers: the params' dimensions around the indices' (a boolean mask gathers the rows
#: a ``Where`` found; a variable's ``ResourceGather``, the rows an embedding looks up).
_GATHERS = frozenset({"Gather", "GatherV2", "GatherNd", "ResourceGather"})

#: How many producers back :class:`Sizer` follows an unknown dimension (through ops
#: that keep it, or keep the element count) before counting it as ``unknown_dim``:
#: bounds the recursion along long chains of unknown shapes.
ESTIMATE_DEPTH = 32

#: How many producers back :meth:`Sizer._estimate_ancestors` estimates before a tensor
#: of unknown shape (those further up count from :data:`ESTIMATE_DEPTH` on their own).
ANCESTOR_DEPTH = 4 * ESTIMATE_DEPTH


def _may_need_estimate(tensor: tf.Tensor) -> bool:
    """Whether an estimate may read ``tensor``: its shape is not fully known, or it is
    an integer scalar or vector (a shape, a reshape's target)."""
    shape = tensor.shape
    if shape.rank is None or not shape.is_fully_defined():
        return True
    return tensor.dtype in (tf.int32, tf.int64) and shape.rank <= 1


class Sizer:
    """Tensor sizes in bytes and op costs, remembered, with the dimensions it had to assume.

    One Sizer can serve several predictions over the same graph.
    """

    def __init__(self, unknown_dim: int = 1, stated: bool = False):
        self.unknown_dim = unknown_dim
        self.stated = stated  # unknown_dim is the batch_size= the caller passed
        self.assumed: set = set()  # names of tensors sized with unknown_dim
        self.bounded: dict = {}  # name -> (static shape, estimate): sized from known tensors alone
        self._frames: list = []  # per shape being estimated: whether unknown_dim was used
        self._bytes: dict = {}
        self._shapes: dict = {}
        self._costs: dict = {}
        self._scratch: dict = {}  # (id(op), gradient) -> (op, bytes): kernel workspaces
        self._per_region: dict = {}  # (id(region), key) -> (region, value)
        self._walked: set = set()  # ops whose outputs' shapes were estimated in order
        self.loops_assumed: set = set()  # loops whose trip count is not static
        self.sparse_assumed: set = set()  # of assumed: a sparse tensor's indices or values

    def __call__(self, tensor: tf.Tensor) -> int:
        # keyed by identity (a graph op keeps its output tensors), tensor kept alive
        found = self._bytes.get(id(tensor))
        if found is None or found[0] is not tensor:
            shape = tensor.shape
            if shape.rank is None or not shape.is_fully_defined():
                dims = self.shape(tensor)
                if graph_lib.has_unknown_size(tensor):
                    if dims is None or self._shapes[id(tensor)][2]:
                        self.assumed.add(tensor.name)
                        if _is_sparse_part(tensor):
                            self.sparse_assumed.add(tensor.name)
                    else:
                        self.bounded[tensor.name] = (shape, dims)
                size = graph_lib.tensor_bytes(tensor, dims=dims)
            else:
                size = graph_lib.tensor_bytes(tensor)
            found = self._bytes[id(tensor)] = (tensor, size)
        return found[1]

    def shape(self, tensor: tf.Tensor, depth: int = 0) -> list | None:
        """The tensor's dimensions, unknown ones estimated (None for an unknown rank).

        An unknown dimension takes its value from the op's inputs where it
        can: a reshape's single unknown dimension holds what the input's
        elements leave over (``[None, 64, 128] -> [None, 128]`` is
        ``[64 * batch, 128]``), and otherwise an input of the same rank,
        unknown at the same place, lends its estimate (a matmul's rows, an
        elementwise op, a gradient of its logits).  What is left counts as
        ``unknown_dim``.  Counting every unknown dimension as ``unknown_dim``
        would get the folded ones wrong by the factor folded in.
        """
        found = self._shapes.get(id(tensor))
        if found is not None and found[0] is tensor:
            self._used_unknown(found[2])
            return found[1]
        if tensor.shape.rank is None:
            self._used_unknown(True)
            return None
        dims = tensor.shape.as_list()
        used = False
        if None in dims:
            if depth == 0:
                self._estimate_ancestors(tensor)
            self._frames.append(False)
            try:
                dims = self._estimate(tensor, dims, depth)
            finally:
                used = self._frames.pop()
        self._shapes[id(tensor)] = (tensor, dims, used)
        self._used_unknown(used)
        return dims

    def _estimate_ancestors(self, tensor: tf.Tensor) -> None:
        """Estimates the unknown shapes above ``tensor`` first, producers before
        consumers, so that its own estimate looks back one op at a time: asked first
        for a tensor far down a chain of unknown shapes, the look-back stopped at
        :data:`ESTIMATE_DEPTH` and what it guessed there stayed (a conv net under an
        STFT front end, asked from its fourth layer: batch 4 in place of the 32 its
        first layer's estimate gives).  The walk follows what an estimate reads (tensors
        of unknown shape, and integer vectors, which may hold a shape), at most
        :data:`ANCESTOR_DEPTH` producers back, each op once per Sizer: a frozen
        backbone thousands of layers above the region is not walked whole.
        """
        found, frontier = [], [tensor.op]
        for _ in range(ANCESTOR_DEPTH):
            above = []
            for op in frontier:
                if op in self._walked:
                    continue
                self._walked.add(op)
                found.append(op)
                above.extend(t.op for t in op.inputs if _may_need_estimate(t))
            if not above:
                break
            frontier = above
        frames, self._frames = self._frames, []  # what they count is their own
        try:
            for op in sorted(found, key=graph_lib.op_order):
                for t in op.outputs:
                    if t is not tensor and t.shape.rank is not None and (
                            not t.shape.is_fully_defined()):
                        self.shape(t)
        finally:
            self._frames = frames

    def _used_unknown(self, used: bool = True) -> None:
        """Notes that the shape being estimated counts ``unknown_dim`` somewhere (itself,
        or through a shape it was estimated from)."""
        if used and self._frames:
            self._frames[-1] = True

    def _fallback(self) -> int:
        """``unknown_dim``, for a dimension nothing known bounds (noted)."""
        self._used_unknown()
        return self.unknown_dim

    def _estimate(self, tensor: tf.Tensor, dims: list, depth: int) -> list:
        op = tensor.op
        inputs = [t for t in op.inputs if t.dtype not in (tf.resource, tf.variant)]
        deep = depth > ESTIMATE_DEPTH  # a long chain of unknown shapes: stop looking back
        if op.type in _SHAPE_INPUT and not deep:
            target = self._target_shape(op, dims, depth)
            if target is not None:
                return target
        if op.type in _BATCH_FACTOR and inputs and not deep:
            rearranged = self._space_batch_shape(op, dims, depth)
            if rearranged is not None:
                return rearranged
        if op.type in _PRODUCTS and len(inputs) == 2 and not deep:
            product = self._product_shape(op, inputs, dims, depth)
            if product is not None:
                return product
        if op.type == "SparseTensorDenseMatMul" and not deep:
            product = self._sparse_product_shape(op, dims, depth)
            if product is not None:
                return product
        if op.type in _SLICES and inputs and not deep:
            sliced = self._slice_shape(op, dims, depth)
            if sliced is not None:
                return sliced
        if op.type in _DATA_BOUNDED and inputs and not deep:
            bounded = self._data_bounded_shape(op, dims, depth)
            if bounded is not None:
                return bounded
        if op.type in _GROWING and len(inputs) >= 2:
            grown = None if deep else self._grown_shape(op, dims, depth)
            return grown or [self._fallback() if d is None else d for d in dims]
        if op.type in _GATHERS and len(op.inputs) >= 2 and not deep:
            gathered = self._gathered_shape(op, dims, depth)
            if gathered is not None:
                return gathered
        if op.type in _SAME_ELEMENTS_OP_TYPES and inputs and not deep:
            source = self.shape(inputs[0], depth + 1)
            if source is not None:
                # the first unknown dimension takes what the others leave over
                unknown = [i for i, d in enumerate(dims) if d is None]
                if len(unknown) > 1:
                    self._used_unknown()
                filled = [self.unknown_dim if d is None else d for d in dims]
                filled[unknown[0]] = 1
                rest = int(np.prod(filled, dtype=np.float64)) or 1
                filled[unknown[0]] = max(1, int(np.prod(source, dtype=np.float64)) // rest)
                return filled
        estimated = list(dims)
        for i, d in enumerate(dims):
            if d is not None:
                continue
            estimated[i] = None
            for t in inputs if not deep else ():
                if t.shape.rank == len(dims) and t.shape.as_list()[i] is None:
                    source = self.shape(t, depth + 1)
                    if source is not None:
                        estimated[i] = source[i]
                        break
            if estimated[i] is None:
                estimated[i] = self._fallback()
        return estimated

    def _slice_shape(self, op: tf.Operation, dims: list, depth: int) -> list | None:
        """A slice's unknown dimensions as its input's: a slice never makes a dimension
        larger, and where its bounds are computed at run time (a random crop's offsets)
        the input's size is the bound to plan for.  A dimension it drops
        (``x[:, 0]``) is left out; None where it adds dimensions, or drops some after an
        ellipsis."""
        shrink = 0
        if op.type == "StridedSlice":
            shrink = op.get_attr("shrink_axis_mask")
            if op.get_attr("new_axis_mask") or (shrink and op.get_attr("ellipsis_mask")):
                return None
        source = self.shape(op.inputs[0], depth + 1)
        if source is None:
            return None
        if op.type == "StridedSlice":
            source = _strided_extents(op, source)
        source = [d for i, d in enumerate(source) if not shrink >> i & 1]
        if len(source) != len(dims):
            return None
        return [source[i] if d is None else d for i, d in enumerate(dims)]

    def _grown_shape(self, op: tf.Operation, dims: list, depth: int) -> list | None:
        """The unknown dimensions of a :data:`_GROWING` op: a concat's along its axis the
        sum of its inputs', its others as its first input's; a tile's its input's times
        the multiple; a pad's its input's plus the padding.  None where the axis, the
        multiples or the padding are not known when the graph is built."""
        if op.type == "ConcatV2":
            axis = tf.get_static_value(op.inputs[-1])
            parts = [self.shape(t, depth + 1) for t in op.inputs[:-1]]
            if axis is None or np.ndim(axis) or any(p is None or len(p) != len(dims)
                                                    for p in parts):
                return None
            axis = int(axis) % len(dims)
            return [d if d is not None else (sum(p[i] for p in parts) if i == axis
                                             else parts[0][i])
                    for i, d in enumerate(dims)]
        source = self.shape(op.inputs[0], depth + 1)
        if source is None or len(source) != len(dims):
            return None
        if op.type == "Tile":
            multiples = shape_values.evaluate(
                op.inputs[1], lambda t: self.shape(t, depth + 1), {}, ESTIMATE_DEPTH - depth)
            if not isinstance(multiples, list) or len(multiples) != len(dims):
                return None
            return [d if d is not None else source[i] * int(multiples[i])
                    for i, d in enumerate(dims)]
        # a pad worked out from shapes (``tf.signal.frame`` with ``pad_end``) as shapes are
        padding = shape_values.evaluate(
            op.inputs[1], lambda t: self.shape(t, depth + 1), {}, ESTIMATE_DEPTH - depth)
        if padding is None or np.shape(padding) != (len(dims), 2):
            return None
        return [d if d is not None else source[i] + int(np.sum(padding[i]))
                for i, d in enumerate(dims)]

    def _data_bounded_shape(self, op: tf.Operation, dims: list, depth: int) -> list | None:
        """The leading dimension of an output whose rows depend on the values (a
        ``Where``'s true elements, a ``Unique``'s distinct ones, a partition's share) as
        the most there can be: its input's elements (for a partition, its data's rows).
        Counting it as the batch got a boolean mask of 1024 rows as 32. None where the
        input's shape is unknown or the output's other dimensions are too."""
        source = self.shape(op.inputs[0], depth + 1)
        if source is None or not dims or None in dims[1:]:
            return None
        if op.type == "DynamicPartition":
            outer = op.inputs[1].shape.rank
            if outer is None:
                return None
            source = source[:outer]
        return [max(1, int(np.prod(source, dtype=np.float64)))] + dims[1:]

    def _gathered_shape(self, op: tf.Operation, dims: list, depth: int) -> list | None:
        """A gather's dimensions: the params' before and after the gathered axis around
        the indices' (``GatherNd``: the indices' but the last, then the params' it does
        not index; ``ResourceGather``: the indices', then what the op's static shape gives
        of the variable's). None where an axis (static, or worked out from shapes) or a
        rank is not known when the graph is built."""
        if op.type == "ResourceGather":
            indices = self.shape(op.inputs[1], depth + 1)
            if indices is None or len(indices) > len(dims) or None in dims[len(indices):]:
                return None
            return list(indices) + dims[len(indices):]
        params, indices = (self.shape(t, depth + 1) for t in op.inputs[:2])
        if params is None or indices is None or not indices:
            return None
        if op.type == "GatherNd":
            indexed = op.inputs[1].shape.as_list()[-1]
            if indexed is None:
                return None
            shape = indices[:-1] + params[indexed:]
        else:
            # an axis computed from a rank (``tf.signal.frame``'s) is worked out as shapes are
            axis = 0 if op.type == "Gather" else shape_values.evaluate(
                op.inputs[2], lambda t: self.shape(t, depth + 1), {}, ESTIMATE_DEPTH - depth)
            batch_dims = op.get_attr("batch_dims") if op.type == "GatherV2" else 0
            if not isinstance(axis, int):
                return None
            axis = int(axis) + (len(params) if int(axis) < 0 else 0)
            shape = params[:axis] + indices[batch_dims:] + params[axis + 1:]
        if len(shape) != len(dims):
            return None
        return [estimate if d is None else d for estimate, d in zip(shape, dims)]

    def _product_shape(self, op: tf.Operation, inputs: list, dims: list,
                       depth: int) -> list | None:
        """A matrix product's last two output dimensions from its operands' (transposed
        or adjoint where the op says: a weight's gradient ``a^T @ g`` has ``a``'s columns
        as rows, not ``g``'s rows); the leading (batch) ones as for other ops."""
        a, b = (self.shape(t, depth + 1) for t in inputs)
        if a is None or b is None or len(a) < 2 or len(b) < 2 or len(dims) < 2:
            return None
        first, second = _PRODUCTS[op.type]
        rows = a[-1] if op.get_attr(first) else a[-2]
        cols = b[-2] if op.get_attr(second) else b[-1]
        estimated = list(dims)
        for i, d in enumerate(dims[:-2]):
            if d is None:
                source = a if len(a) == len(dims) else b
                estimated[i] = source[i] if len(source) == len(dims) else self._fallback()
        estimated[-2] = dims[-2] if dims[-2] is not None else rows
        estimated[-1] = dims[-1] if dims[-1] is not None else cols
        return estimated

    def _sparse_product_shape(self, op: tf.Operation, dims: list, depth: int) -> list | None:
        """A sparse-dense product's dimensions: the sparse operand's rows (from its dense
        shape's value: ``tf.compat.v1.sparse_placeholder(shape=...)`` feeds a default)
        and the dense operand's columns, each transposed where the op says."""
        dense_shape = shape_values.evaluate(
            op.inputs[2], lambda t: self.shape(t, depth + 1), {}, ESTIMATE_DEPTH - depth)
        b = self.shape(op.inputs[3], depth + 1)
        if (not isinstance(dense_shape, list) or len(dense_shape) != 2 or b is None
                or len(b) != 2 or len(dims) != 2):
            return None
        rows = dense_shape[1] if op.get_attr("adjoint_a") else dense_shape[0]
        cols = b[0] if op.get_attr("adjoint_b") else b[1]
        estimated = [dims[0] if dims[0] is not None else int(rows),
                     dims[1] if dims[1] is not None else int(cols)]
        return estimated if min(estimated) >= 0 else None

    def _space_batch_shape(self, op: tf.Operation, dims: list, depth: int) -> list | None:
        """The dimensions of an op that moves spatial blocks into the batch or back (a
        dilated convolution's ``SpaceToBatchND`` / ``BatchToSpaceND``): its batch is its
        input's times (or over) the block count; other unknown ones as the input's."""
        source = self.shape(op.inputs[0], depth + 1)
        if source is None or len(source) != len(dims):
            return None
        multiply, block = _BATCH_FACTOR[op.type]
        if block is None:  # the block's size is an attribute, per spatial dimension
            count = int(op.get_attr("block_size")) ** 2
        else:
            # a fresh cache each time: a value remembered across calls would not say
            # whether it counted the unknown size (see _used_unknown)
            value = shape_values.evaluate(op.inputs[block], lambda t: self.shape(t, depth + 1),
                                          {}, ESTIMATE_DEPTH - depth)
            if not isinstance(value, list) or not value:
                return None
            count = int(np.prod([int(d) for d in value], dtype=np.float64))
        batch = source[0] * count if multiply else max(1, source[0] // max(1, count))
        estimated = [batch if dims[0] is None else dims[0]]
        return estimated + [source[i] if d is None else d for i, d in enumerate(dims[1:], 1)]

    def _target_shape(self, op: tf.Operation, dims: list, depth: int) -> list | None:
        """The output dimensions of an op that takes them from a shape tensor (a reshape's
        target, a fill's dimensions), where that tensor's value follows from the
        estimated shapes it is computed from (:mod:`.shape_values`); a reshape's -1 takes
        what its input's elements leave over.  None where it cannot be worked out."""
        value = shape_values.evaluate(
            op.inputs[_SHAPE_INPUT[op.type]], lambda t: self.shape(t, depth + 1),
            {}, ESTIMATE_DEPTH - depth)
        if not isinstance(value, list) or len(value) != len(dims):
            return None
        target = [int(d) for d in value]
        if target.count(-1) == 1 and op.type == "Reshape":
            source = self.shape(op.inputs[0], depth + 1)
            if source is None:
                return None
            rest = int(np.prod([d for d in target if d != -1], dtype=np.float64)) or 1
            target[target.index(-1)] = max(1, int(np.prod(source, dtype=np.float64)) // rest)
        if any(d < 0 for d in target) or any(
                known is not None and known != d for known, d in zip(dims, target)):
            return None
        return target

    def loop_bytes(self, op: tf.Operation) -> int:
        """Bytes a v2 while loop keeps for its gradient (:func:`graph.loop_accumulators`):
        each iteration's tensors times its trip count (``unknown_dim`` where the count is
        not static, and said among the assumptions); 0 for any other op."""
        return self._loop_sizes(op)[0]

    def loop_gradient_bytes(self, op: tf.Operation) -> int:
        """Bytes a v2 while loop's gradient makes besides what the loop kept: the zeros
        it writes into the gradient of each list the body writes an item of unknown
        shape into (:attr:`graph.LoopAccumulators.zeros_per_step`), times the trip
        count; 0 for any other op.  The simulation holds them from the backward pass's
        start to the loop's gradient."""
        return self._loop_sizes(op)[1]

    def _loop_sizes(self, op: tf.Operation) -> tuple:
        key = ("loop", op)
        found = self._costs.get(key)
        if found is None:
            kept = graph_lib.loop_accumulators(op)
            found = (0, 0)
            if kept is not None and (kept.per_step or kept.zeros_per_step):
                steps = kept.steps
                if steps is None:
                    steps = self.unknown_dim
                    self.loops_assumed.add(op.name)
                found = (steps * sum(self(t) for t in kept.per_step),
                         steps * sum(self(t) for t in kept.zeros_per_step))
            self._costs[key] = found
        return found

    def per_region(self, region: graph_lib.ForwardRegion, key: Hashable, make: Callable[[], _T]) -> _T:
        """``make()``, computed once per region and ``key`` and remembered: what
        every prediction over the same region shares."""
        found = self._per_region.get((id(region), key))
        if found is None or found[0] is not region:
            found = self._per_region[(id(region), key)] = (region, make())
        return found[1]

    def scratch(self, op: tf.Operation, gradient: bool = False) -> int:
        """Bytes ``op``'s kernel (``gradient``: its gradient's kernels) allocates besides
        its outputs while it runs (:mod:`.workspace`), remembered."""
        key = (id(op), gradient)
        found = self._scratch.get(key)
        if found is None or found[0] is not op:
            measure = workspace.gradient_bytes if gradient else workspace.forward_bytes
            found = self._scratch[key] = (op, measure(op, self, self.shape))
        return found[1]

    def kept_for_gradient(self, op: tf.Operation) -> int:
        """Bytes ``op``'s kernel keeps for its gradient beside its outputs
        (:func:`.workspace.kept_for_gradient_bytes`), remembered."""
        key = ("kept", op)
        found = self._costs.get(key)
        if found is None:
            found = self._costs[key] = workspace.kept_for_gradient_bytes(op, self)
        return found

    def cost(self, op: tf.Operation) -> float:
        """What recomputing ``op`` costs the planner: the time model's seconds
        (:meth:`seconds`)."""
        return self.seconds(op)

    def seconds(self, op: tf.Operation) -> float:
        """:func:`op_seconds`, with this Sizer's sizes."""
        key = ("seconds", op)
        found = self._costs.get(key)
        if found is None:
            found = self._costs[key] = op_seconds(op, self)
        return found

    def assumptions(self) -> tuple:
        notes = ()
        if self.loops_assumed:
            loops = sorted(self.loops_assumed)
            notes += (f"{len(loops)} while {'loop' if len(loops) == 1 else 'loops'} (e.g. "
                      f"{loops[0]}) {'has' if len(loops) == 1 else 'have'} no static trip count: "
                      f"the steps each keeps for its gradient are counted as {self.unknown_dim} "
                      "(batch_size= sets it, and plan.peak_at(n) gives the peaks at n)",)
        if self.bounded:
            name = min(self.bounded)
            shape, dims = self.bounded[name]
            count = len(self.bounded)
            notes += (f"{count} {'tensor has' if count == 1 else 'tensors have'} unknown "
                      f"dimensions bounded by known ones and counted at that bound (e.g. "
                      f"{name} {shape} as {tuple(dims)}: a slice is planned at the extent its "
                      "bounds give, or at its input's whole size where they do not, a boolean "
                      "mask's rows at all rows, a sparse product's rows at its sparse "
                      "operand's dense shape)",)
        if not self.assumed:
            return notes
        names = sorted(self.assumed)
        counted = (f"{self.unknown_dim}, the batch_size= passed" if self.stated
                   else str(self.unknown_dim))
        advice = "" if self.stated else "; pass batch_size= to state the size you feed"
        if self.sparse_assumed:
            sparse = sorted(self.sparse_assumed)
            advice += (f"; {', '.join(sparse[:2])} {'is' if len(sparse) == 1 else 'are'} a "
                       "sparse tensor's indices or values, whose unknown count of values is "
                       "counted so too (batch_size= sets both)")
        return (
            f"{len(names)} {'tensor has' if len(names) == 1 else 'tensors have'} unknown "
            f"dimensions, counted as {counted} (e.g. {', '.join(names[:3])}){advice}",
        ) + notes


#: :data:`.ops.CONVOLUTIONS`.
CONVOLUTION_OP_TYPES = op_types.CONVOLUTIONS


def _is_sparse_part(tensor: tf.Tensor) -> bool:
    """Whether ``tensor`` is a sparse tensor's indices or values: the first two inputs of
    a sparse op (``SparseTensorDenseMatMul``, ``SparseReshape``, ...)."""
    return any(consumer.type.startswith("Sparse")
               and any(t is tensor for t in consumer.inputs[:2])
               for consumer in tensor.consumers())


def _strided_extents(op: tf.Operation, source: list) -> list:
    """A strided slice's extent along each axis of its input (``source``: the input's
    dimensions): where its begin and end are computed while the step runs but their
    difference is not (a micro-batch ``x[i * 256:(i + 1) * 256]``: 256 rows), that
    difference, at most the input's; else the input's, the bound.  Stride 1 only."""
    if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
        return source
    begin, end = (shape_values.affine(t) for t in op.inputs[1:3])
    strides = tf.get_static_value(op.inputs[3])
    if (not isinstance(begin, list) or not isinstance(end, list) or strides is None
            or len(begin) != len(end) or len(begin) > len(source)):
        return source
    begin_mask, end_mask = op.get_attr("begin_mask"), op.get_attr("end_mask")
    extents = list(source)
    for axis, (start, stop, stride) in enumerate(zip(begin, end, strides.tolist())):
        if stride != 1 or (begin_mask | end_mask) >> axis & 1:
            continue
        length = shape_values.constant_difference(stop, start)
        if length is not None:
            extents[axis] = max(0, min(length, source[axis]))
    return extents


#: The unknown size :func:`outside_estimates` sizes with: a prime no real dimension is
#: likely to equal, so that its estimates tell apart shapes whose unknown parts differ.
_SIGNATURE_DIM = 7919


def outside_estimates(region: graph_lib.ForwardRegion) -> tuple:
    """What the memory model makes of the tensors the region reads from outside it
    whose shape or value is not static: each one's estimated dimensions, and the value
    of an integer scalar or vector (a reshape's target), as worked out from the ops
    above it.  Two regions alike op for op can differ here (an STFT front end above one
    of them), and then so do their plans; and which of them the step computes
    (:attr:`.graph.ForwardRegion.computed_outside`, counted) with their buffers' shapes."""
    size = Sizer(_SIGNATURE_DIM)

    def frozen(value):
        return tuple(value) if isinstance(value, list) else value

    found = []
    for t in graph_lib.read_from_outside(region):
        if t.dtype in (tf.resource, tf.variant):
            continue
        if t.dtype in (tf.int32, tf.int64) and t.shape.rank in (0, 1) and (
                tf.get_static_value(t) is None):
            found.append(frozen(shape_values.evaluate(t, size.shape)))
        elif t.shape.rank is None or not t.shape.is_fully_defined():
            found.append(frozen(size.shape(t)))
    computed = tuple((buffer.op.type, frozen(size.shape(buffer)))
                     for t, buffer in region.computed_outside)
    return tuple(found), computed


def counts_unknown_sizes(region: graph_lib.ForwardRegion) -> bool:
    """Whether the memory model counts any of the region's sizes as the unknown size
    (``Sizer.unknown_dim``): False where every shape is known, or every unknown one is
    bounded by known tensors (a slice of a known tensor, its rows picked by a mask), so
    that the plan's figures hold whatever is fed.  Worked out once per region object
    (the strategy and the plan of one call both ask)."""
    found = _counts_unknown.get(region)
    if found is None:
        found = _counts_unknown[region] = _sizes_counted_as_unknown(region)
    return found


_counts_unknown: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # region -> bool


def _sizes_counted_as_unknown(region: graph_lib.ForwardRegion) -> bool:
    size = Sizer(1)
    for t in graph_lib.unknown_size_tensors(region):
        size(t)
    for op in region.order:
        size.loop_bytes(op)
    return bool(size.assumed or size.loops_assumed)


def loop_note(region: graph_lib.ForwardRegion) -> tuple:
    """A note where the region's while loops keep their steps' tensors in TensorLists
    for the backward pass: counted from the loop bodies, never planned."""
    loops = [op for op in region.order if op.type in graph_lib.WHILE_OP_TYPES]
    notes = ()
    if loops:
        notes += (f"{len(loops)} while loop(s) (e.g. {loops[0].name}, a recurrent layer) "
                  "keep their steps' tensors for the backward pass in TensorLists: both "
                  "peaks count them from each loop's body (the tensors its gradient reads, "
                  "times its trip count), they are kept whatever the plan, and only what "
                  "lies outside the loops is planned",)
    frames = {op.get_attr("frame_name") for op in region.order if op.type in op_types.V1_ENTERS}
    if frames:
        notes += (f"{len(frames)} v1 control-flow while loop(s) (tf.compat.v1.while_loop "
                  "with control flow v2 off, e.g. dynamic_rnn) keep their steps' tensors "
                  "for the backward pass in stacks that neither peak counts: both are low "
                  "by those stacks (about 3x on a two-layer dynamic_rnn), the saving "
                  "outside the loops holds",)
    return notes


def python_function_note(region: graph_lib.ForwardRegion) -> tuple:
    """A note where the forward pass calls ``tf.py_function``: the tensors its Python
    code makes, and the eager tape TensorFlow keeps from each call for its gradient, use
    the same allocator and are not in the graph the model sees (a helper's trial: three
    calls of ``sin(sin(sin(x)))`` on [1024, 256] in a 10-layer MLP, in a ``tf.function``,
    measured 5-6.5 MiB above both planned peaks; ``x + 1``: as planned)."""
    calls = [op for op in region.order if op.type in op_types.EAGER_PYTHON_FUNCTIONS]
    if not calls:
        return ()
    return (f"{len(calls)} tf.py_function call(s) (e.g. {calls[0].name}): the tensors their "
            "Python code makes, and the eager tape TensorFlow keeps from each call for its "
            "gradient, are not in these peaks (three calls in a 10-layer MLP measured 5-6.5 "
            "MiB above both): measure the step (peak_memory_during)",)


#: Name scopes TensorFlow builds gradients in: ``tf.gradients`` (and this library's
#: rewrite) ``gradients``, ``gradients_1``, ...; a ``tf.GradientTape`` in a graph
#: ``gradient_tape``.
#: A name scope ``tf.gradients`` or a tape opens: ``gradients``, ``gradient_tape_2``, ...
_GRADIENT_SCOPE_NAME = re.compile("(?:gradients|gradient_tape)(?:_[0-9]+)?")

#: How :func:`other_backward_note`'s note begins (the one over the same forward pass).
SAME_FORWARD_NOTE = "the graph already holds another backward pass over this forward pass"


def _gradient_scope(op: tf.Operation) -> str | None:
    """The name scope of the gradient computation that built ``op`` (``'gradients_1'``,
    ``'model/gradient_tape'``), or None for an op built outside one (a scope named
    ``'gradients_summary'`` is none)."""
    parts = op.name.split("/")[:-1]
    for i, part in enumerate(parts):
        if _GRADIENT_SCOPE_NAME.fullmatch(part):
            return "/".join(parts[:i + 1])
    return None


def other_backward_note(region: graph_lib.ForwardRegion,
                        counts: Callable[[tf.Operation], bool] = lambda op: True) -> tuple:
    """A note where the graph already holds another backward pass that reads this
    region's tensors (a second tape or ``tf.gradients`` call over the same forward
    pass: a GAN's two losses, a persistent tape used twice), which the peaks leave out.

    A gradient computation with ops inside the region (a gradient penalty's inner
    gradient) is part of this pass's forward and counted; ops that only read shapes
    hold nothing; ops for which ``counts`` is false (this computation's own backward
    pass, already built) are left out.
    """
    inside = {scope for scope in map(_gradient_scope, region.order) if scope}
    readers = {}
    for op in region.order:
        for t in op.outputs:
            for consumer in t.consumers():
                if consumer in region or consumer.type in op_types.SHAPE_ONLY_READERS:
                    continue
                scope = _gradient_scope(consumer)
                if scope and scope not in inside and counts(consumer):
                    readers[consumer] = scope
    if not readers:
        return ()
    example = min(readers, key=graph_lib.op_order).name
    return (f"{SAME_FORWARD_NOTE} ({len(readers)} gradient op(s) outside it read its tensors, e.g. {example}: "
            "a second tape or tf.gradients call, as in a GAN, or a persistent tape's "
            "earlier gradient; ops under a 'recompute' scope are the copies this library "
            "built for it): both peaks count only this "
            "gradient computation's backward pass, and a step that runs both holds more "
            "(docs/usage.md)",)


def concurrent_backward_note(region: graph_lib.ForwardRegion,
                             counts: Callable[[tf.Operation], bool] = lambda op: True) -> tuple:
    """A note where the graph already holds another gradient computation over another
    forward pass (micro-batches' tapes unrolled in a Python loop) on this region's
    devices, and nothing makes this region wait for any of it: the executor may run
    both at once, and the peaks count only this one.

    Ops of gradient computations built inside the region (a gradient penalty's), ops
    for which ``counts`` is false (this computation's own backward pass) and
    computations placed on other devices only (replicas on their own devices) are left
    out; a computation that reads this region's tensors is :func:`other_backward_note`'s.
    Linear in the graph.
    """
    if not region.order:
        return ()
    inside = {scope for scope in map(_gradient_scope, region.order) if scope}
    graph_ops = region.order[0].graph.get_operations()
    by_scope: dict = collections.defaultdict(list)
    for op in graph_ops:
        scope = _gradient_scope(op)
        if scope is not None and scope not in inside and op not in region and counts(op):
            by_scope[scope].append(op)
    devices = _placed_devices(region.order)
    others = [op for ops in by_scope.values()
              if not devices or not _placed_devices(ops) or _placed_devices(ops) & devices
              for op in ops]
    if not others or _waits_for_any(region, others, graph_ops):
        return ()
    example = min(others, key=graph_lib.op_order).name
    return (f"the graph already holds another gradient computation over another forward "
            f"pass ({len(others)} op(s), e.g. {example}: micro-batches' tapes unrolled in "
            "a Python loop, or two models' losses, as an actor's and a critic's) that "
            "nothing makes this one wait for: the executor may run "
            "them side by side, and both peaks count only this gradient computation "
            "(docs/usage.md)",)


def _placed_devices(ops: Sequence[tf.Operation]) -> set:
    """The (device type, index) pairs ``ops`` are placed on; unplaced ops add none."""
    placed = set()
    for device in {op.device for op in ops}:
        if device:
            spec = tf.DeviceSpec.from_string(device)
            placed.add((spec.device_type, spec.device_index))
    return placed


def _waits_for_any(region: graph_lib.ForwardRegion, others: Sequence[tf.Operation],
                   graph_ops: Sequence[tf.Operation]) -> bool:
    """Whether the region's ops wait for one of ``others``: one is their ancestor, or
    what is built on one writes a resource the region reads before the region reads it
    (in a ``tf.function``, TensorFlow makes a read wait for the writes made before it
    once the function is traced: a micro-batch's update before the next one's forward
    pass).  What is built on an op goes on through the resources it writes to their
    later reads (an optimizer's slot: the gradient into a moment, the moment into the
    weight).  ``graph_ops``: every op of the graph."""
    others = set(others)
    waited_for: set = set()  # the region's ancestors
    stack = [t.op for op in region.order for t in op.inputs]
    stack += [c for op in region.order for c in op.control_inputs]
    while stack:
        op = stack.pop()
        if op in waited_for:
            continue
        if op in others:
            return True
        waited_for.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    first_read: dict = {}  # resource read in the region -> its first reader's order
    for op in region.order:
        for t in op.inputs:
            if t.dtype == tf.resource:
                order = graph_lib.op_order(op)
                first_read[t.ref()] = min(first_read.get(t.ref(), order), order)
    readers: dict = collections.defaultdict(list)  # resource -> ops reading it
    for op in graph_ops:
        for t in op.inputs:
            if t.dtype == tf.resource:
                readers[t.ref()].append(op)
    built_on: set = set()
    stack = list(others)
    while stack:
        op = stack.pop()
        if op in built_on:
            continue
        built_on.add(op)
        stack.extend(c for t in op.outputs for c in t.consumers())
        if op.type == "ReadVariableOp" or op.op_def is None or not op.op_def.is_stateful:
            continue
        order = graph_lib.op_order(op)
        for t in op.inputs:
            if t.dtype != tf.resource:
                continue
            if order < first_read.get(t.ref(), -1):
                return True
            stack.extend(r for r in readers[t.ref()] if graph_lib.op_order(r) > order)
    return False


def workspace_note(region: graph_lib.ForwardRegion, onednn: bool, gpu: bool) -> tuple:
    """What the model leaves out on this machine, as a line for ``Plan.assumptions``.

    TensorFlow's own CPU gradients of a convolution allocate a transient workspace
    besides their outputs (measured 14-27 MB per op at batch 8 on a CIFAR ResNet, two
    at a time when the input and filter gradients run together); the model counts
    outputs only, so its peaks are too low there.  They run where oneDNN is off, and
    with oneDNN on for float16 convolutions: its CPU kernels take float32 and
    bfloat16 only (a conv net at batch 16 under Keras' ``mixed_float16``: planned 11.1
    MB, measured 37.6; under ``mixed_bfloat16`` 12.0).
    """
    xla = _xla_call_note(region)
    if gpu:
        return xla
    convolutions = [op for op in region.order if op.type in CONVOLUTION_OP_TYPES]
    if onednn:
        convolutions = [op for op in convolutions
                        if op.outputs and op.outputs[0].dtype == tf.float16]
    if not convolutions:
        return xla
    count = len(convolutions)
    if not onednn:
        return xla + (
            f"oneDNN is off (TF_ENABLE_ONEDNN_OPTS): TensorFlow's CPU gradients of the {count} "
            "convolutions allocate transient workspaces (measured 14-27 MB per op at batch 8) "
            "that these peaks leave out; set TF_ENABLE_ONEDNN_OPTS=1 before importing "
            "TensorFlow (docs/where-it-works.md)",
        )
    return xla + (
        f"{count} convolution(s) compute in float16, which oneDNN's CPU kernels do not take: "
        "TensorFlow's own gradients of them allocate transient workspaces (a conv net at "
        "batch 16: planned 11.1 MB, measured 37.6) that these peaks leave out; on CPU use "
        "bfloat16 (Keras' mixed_bfloat16) instead (docs/where-it-works.md)",
    )


def _xla_call_note(region: graph_lib.ForwardRegion) -> tuple:
    """A line for ``Plan.assumptions`` where the forward pass calls functions that XLA
    compiles (``_XlaMustCompile``: Keras 3 runs a grouped or depthwise ``Conv2D`` so on
    CPU): what XLA allocates inside them, and in their gradients, is not modelled.  A
    Keras ``Conv2D(768, 7, groups=768)`` on a 4x2x2x768 input: its gradient step measured
    256 MB for a 0.14 MB filter; a Keras ConvNeXtTiny step 324 MB against 141 predicted."""
    calls = [op for op in region.order if op.type in op_types.FUNCTION_CALLS
             and "_XlaMustCompile" in op.node_def.attr and op.get_attr("_XlaMustCompile")]
    if not calls:
        return ()
    return (
        f"{len(calls)} op(s) call functions that XLA compiles (e.g. {calls[0].name}: Keras "
        "runs grouped and depthwise convolutions so on CPU); the buffers XLA allocates in "
        "them and in their gradients are not in these peaks (a Keras ConvNeXtTiny step "
        "measured 324 MB against 141 predicted): measure the step (peak_memory_during)",
    )


#: Flops per output element of a fused batch normalization: its statistics (mean,
#: variance), then the normalisation; a rough count (its time is mostly memory traffic).
BATCH_NORM_FLOPS_PER_ELEMENT = 10.0


def _static_shape(tensor: tf.Tensor) -> list | None:
    return tensor.shape.as_list() if tensor.shape.rank is not None else None


def op_flops(op: tf.Operation, shape: Callable[[tf.Tensor], list | None] = _static_shape) -> float:
    """Rough floating-point work of one op, from its shapes (``shape(tensor)``:
    a list of dimensions, or None; static shapes by default, unknown
    dimensions counting as 1)."""

    def dims_of(t):
        return shape(t) or []

    def elements(t):
        n = 1
        for d in dims_of(t):
            n *= d or 1
        return n

    out = elements(op.outputs[0]) if op.outputs else 0
    if op.type in ("Conv2D", "Conv3D", "DepthwiseConv2dNative", "_FusedConv2D",
                   "Conv2DBackpropInput"):
        filt = dims_of(op.inputs[1])
        per_out = 1
        for d in filt[:-1] if op.type != "DepthwiseConv2dNative" else filt[:-2]:
            per_out *= d or 1
        return 2.0 * out * per_out
    if op.type in ("MatMul", "_FusedMatMul", "BatchMatMul", "BatchMatMulV2",
                   "BatchMatMulV3", "Einsum"):
        first = dims_of(op.inputs[0]) or [1]
        inner = first[-1] or 1
        if op.type in ("MatMul", "_FusedMatMul") and op.get_attr("transpose_a"):
            inner = first[0] or 1
        return 2.0 * out * inner
    if op.type.startswith("FusedBatchNorm"):
        return BATCH_NORM_FLOPS_PER_ELEMENT * out  # statistics, then normalisation
    return float(out)


def op_seconds(op: tf.Operation, size: Callable[[tf.Tensor], int] = graph_lib.tensor_bytes,
               traffic_share: float = 1.0) -> float:
    """The time model's seconds for one op (:func:`.timing.op_seconds`, this machine's
    calibration or the default): its FLOPs at its kind's rate, or its bytes at the
    memory bandwidth (times ``traffic_share``: less where the cache holds some),
    whichever is slower, plus the fixed cost of a kernel."""
    traffic = sum(size(t) for t in list(op.inputs) + list(op.outputs))
    shape = getattr(size, "shape", _static_shape)
    return timing.op_seconds(op_flops(op, shape), traffic, timing.kind_of(op.type),
                             timing.current(), traffic_share)


def step_seconds(region: graph_lib.ForwardRegion, size: Sizer) -> tuple[float, float]:
    """The time model's (forward, backward) seconds of the region's ops: each op, and its
    gradient (:func:`.timing.backward_seconds`) where a gradient flows through it.  The
    same for every plan of the region: worked out once per ``Sizer``."""
    return size.per_region(region, "step_seconds", lambda: _step_seconds(region, size))


def _step_seconds(region: graph_lib.ForwardRegion, size: Sizer) -> tuple[float, float]:
    throughput = timing.current()
    forward = backward = 0.0
    for op in region.order:
        if op.type in _NO_KERNEL_OP_TYPES:
            continue
        forward += size.seconds(op)
        backward += _gradient_seconds(op, size, throughput)
    return forward, backward


def _gradient_seconds(op: tf.Operation, size: Sizer, throughput, traffic_share: float = 1.0) -> float:
    """The time model's seconds of ``op``'s gradient (0 for an op without a kernel)."""
    if op.type in _NO_KERNEL_OP_TYPES or op.type in op_types.SHAPE_ONLY_READERS:
        return 0.0
    return timing.backward_seconds(_priced_seconds(op, size, traffic_share),
                                   timing.kind_of(op.type), throughput)


def _priced_seconds(op: tf.Operation, size: Sizer, traffic_share: float) -> float:
    """:meth:`Sizer.seconds` (remembered), or with ``traffic_share`` of its bytes' cost."""
    return size.seconds(op) if traffic_share == 1.0 else op_seconds(op, size, traffic_share)


def timed_seconds(timeline: "_Timeline", size: Sizer, end_step: float,
                  cache_bytes: int | None = None) -> float:
    """The time model's seconds of every kernel a replay ran (forward, copies,
    gradients), each kernel's bytes priced by where the replay finds them: in the
    last-level cache or in memory (:mod:`.step_time`; ``cache_bytes``: the cache, by
    default this machine's, :func:`.timing.cache_bytes`)."""
    throughput = timing.current()
    cache = timing.cache_bytes() if cache_bytes is None else cache_bytes
    fits = 0 < timeline.peak(end_step) <= cache
    traffic = step_time.cached_traffic(timeline.buffers, timeline.reads, timeline.executed,
                                       cache, fits)

    def price(ran, cached, uncached):
        op, role = ran
        share = timing.traffic_share(cached, uncached, throughput)
        if role == "backward":
            return _gradient_seconds(op, size, throughput, share)
        return _priced_seconds(op, size, share)

    return step_time.step_seconds(traffic, timeline.executed, price)


#: Ops that run no kernel of their own in a step (grappler folds constants; a
#: placeholder is fed).
_NO_KERNEL_OP_TYPES = frozenset({"Const", "Placeholder", "PlaceholderWithDefault", "NoOp"})


class _Timeline:
    """Buffers with [start, end] steps; the peak is a sweep over them.

    It also notes, for the step-time prediction's cache term (:func:`timed_seconds`),
    which buffers each step reads (``reads``: (step, buffer key)) and which op runs
    at each step, and as what (``executed``: step -> (op, ``"forward"``,
    ``"recompute"`` or ``"backward"``))."""

    def __init__(self):
        self.buffers: dict = {}
        self.alias: dict = {}
        self.reads: list = []
        self.executed: dict = {}
        # step -> the buffers an elementwise kernel there may write into (in_place)
        self.in_place: dict = {}

    def alloc(self, key, size: int, step: float) -> None:
        self.buffers[key] = [step, step, size]
        self.alias[key] = key

    def alias_of(self, key, source) -> None:
        root = self.alias.get(source)
        if root is not None:
            self.alias[key] = root

    def use(self, key, step: float) -> None:
        root = self.alias.get(key)
        if root is not None:
            self.reads.append((step, root))
            if self.buffers[root][1] < step:
                self.buffers[root][1] = step

    def note_in_place(self, step: float, op: tf.Operation, input_keys, nbytes: int) -> None:
        """``op`` at ``step``, an :data:`.ops.IN_PLACE_ELEMENTWISE` kernel with an output of
        ``nbytes``, may write into the buffer of one of its inputs (``input_keys``, those of
        its output's dtype) where this step is that buffer's last read."""
        roots = [self.alias.get(key) for key in input_keys]
        found = [root for root in roots if root is not None and self.buffers[root][2] == nbytes
                 and self.buffers[root][0] < step]
        if found:
            self.in_place[step] = found

    def _settle_in_place(self) -> None:
        """Frees, as its step starts, the first buffer each in-place kernel may write into
        whose last read it is (TensorFlow forwards it to the output).  Idempotent: a read
        added later moves the end on again."""
        buffers = self.buffers
        for step, roots in self.in_place.items():
            for root in roots:
                row = buffers[root]
                if row[1] == step:
                    row[1] = step - 0.5
                    break
                if row[1] == step - 0.5:
                    break  # settled before

    def copy(self) -> "_Timeline":
        other = _Timeline()
        other.buffers = {key: list(buffer) for key, buffer in self.buffers.items()}
        other.alias = dict(self.alias)
        other.reads = list(self.reads)
        other.executed = dict(self.executed)
        other.in_place = dict(self.in_place)
        return other

    def live(self, end_step: int) -> np.ndarray:
        """Bytes live at each step ``0..end_step`` (a buffer counts from its first step to
        its last use; those kept to the end, to ``end_step``): its max is :meth:`peak`."""
        self._settle_in_place()
        live = np.zeros(end_step + 2, dtype=np.int64)
        for start, end, size in self.buffers.values():
            if size:
                live[int(start)] += size
                live[int(min(end, end_step)) + 1] -= size
        return np.cumsum(live)[:-1]

    def peak(self, end_step: float) -> int:
        """Most bytes live at once; a buffer ends half a step after its last use."""
        self._settle_in_place()
        rows = np.array([b for b in self.buffers.values() if b[2]], dtype=float).reshape(-1, 3)
        if not len(rows):
            return 0
        ends = np.where(rows[:, 1] == _END, end_step, rows[:, 1]) + 0.5
        times = np.concatenate([rows[:, 0], ends])
        deltas = np.concatenate([rows[:, 2], -rows[:, 2]])
        order = np.lexsort((deltas, times))  # by time, frees before allocations
        return int(max(0.0, np.cumsum(deltas[order]).max()))


def _gradient_size(tensor: tf.Tensor, consumer: tf.Operation, size) -> int:
    """Bytes of the gradient ``consumer`` emits for its input ``tensor``.

    A handle's (resource or variant) gradient is as large as what the consumer
    reads through it (a variable read, a ``TensorListStack``), when its first output
    holds those values; otherwise (a loop's list going into the ``While``) its size
    is not known statically and counts as 0.  A gather's params gradient is an
    ``IndexedSlices``: the gathered rows' values and their indices.
    """
    if (consumer.type in op_types.GATHERS and tensor.ref() == consumer.inputs[0].ref()
            and graph_lib.gathers_rows(consumer)):
        return size(consumer.outputs[0]) + size(consumer.inputs[1])
    if graph_lib.is_float_or_complex(tensor):
        return size(tensor)
    if consumer.outputs and graph_lib.is_float_or_complex(consumer.outputs[0]):
        return size(consumer.outputs[0])
    return 0


def _forward_timeline(region, size: Sizer) -> tuple:
    """A fresh timeline holding the forward pass, and the steps it took.

    The forward pass is the same for every prediction over a region: the
    ``Sizer`` keeps it, and each prediction starts from a copy.
    """

    def make():
        timeline = _Timeline()
        return timeline, _forward(timeline, region, size)

    timeline, steps = size.per_region(region, "forward", make)
    return timeline.copy(), steps


def _forward(timeline: _Timeline, region, size) -> int:
    end = len(region.order)
    # what the step computes outside the region (a dropout's mask) depends on nothing the
    # region makes: the executor runs it as soon as the step starts
    for t, buffer in region.computed_outside:
        if buffer.ref() not in timeline.alias:
            timeline.alloc(buffer.ref(), size(buffer), 0)
        timeline.alias_of(t.ref(), buffer.ref())
    for step, op in enumerate(region.order):
        if op.type not in _NO_KERNEL_OP_TYPES:
            timeline.executed[step] = (op, "forward")
        for t in op.inputs:
            timeline.use(t.ref(), step)
        if op.type in graph_lib.WHILE_OP_TYPES:
            # what the loop keeps of each iteration, until its gradient pops it
            timeline.alloc(_loop_key(op), size.loop_bytes(op), step)
            # the zeros its gradient writes (Sizer.loop_gradient_bytes): TensorFlow runs a
            # loop as dataflow, and the gradient loop makes them from what it pops, without
            # waiting for its incoming gradient: from the backward pass's start
            timeline.alloc(_loop_zeros_key(op), size.loop_gradient_bytes(op), end)
        for t in op.outputs:
            source = graph_lib.forwarded_input(t)
            if source is not None:
                timeline.alias_of(t.ref(), source.ref())
                if t.ref() not in timeline.alias:
                    timeline.alloc(t.ref(), 0, step)
            else:
                timeline.alloc(t.ref(), size(t), step)
        _note_in_place(timeline, op, step, size, lambda ref: ref)
        kept = size.kept_for_gradient(op)
        if kept:
            timeline.alloc(_kept_key(op.outputs[0].ref()), kept, step)
        _scratch(timeline, size.scratch(op), step)
    return len(region.order)


def _note_in_place(timeline: _Timeline, op: tf.Operation, step: float, size, rename) -> None:
    """Notes an elementwise kernel that may write into an input's buffer (see
    :meth:`_Timeline.note_in_place`)."""
    if op.type in op_types.IN_PLACE_ELEMENTWISE and len(op.outputs) == 1:
        out = op.outputs[0]
        timeline.note_in_place(step, op, [rename(t.ref()) for t in op.inputs
                                          if t.dtype == out.dtype], size(out))


def _scratch(timeline: _Timeline, nbytes: int, step: float) -> None:
    """A kernel's workspace: live at its step only."""
    if nbytes:
        timeline.alloc(("scratch", step), nbytes, step)


class _Gradients:
    """Gradient contributions waiting for the backward step of their tensor's producer."""

    def __init__(self, timeline: _Timeline):
        self.timeline = timeline
        self.pending: dict = {}
        self.count = 0
        self._added: list = []  # the ref of each add, in order
        self._added_at: list = []  # the key number of each add (increasing)

    def add(self, ref, size: int, step: float) -> None:
        """A gradient for the tensor with this ``ref()``."""
        key = ("grad", self.count)
        self._added.append(ref)
        self._added_at.append(self.count)
        self.count += 1
        self.timeline.alloc(key, size, step)
        self.pending.setdefault(ref, []).append(key)

    def has(self, tensor: tf.Tensor) -> bool:
        return tensor.ref() in self.pending

    def pending_bytes(self, ref) -> int:
        """The bytes of the gradients waiting for the tensor with this ``ref()``."""
        return sum(self.timeline.buffers[key][2] for key in self.pending.get(ref, ()))

    def has_any(self, refs) -> bool:
        """Whether a gradient waits for any of the tensors with these ``ref()`` s."""
        return any(ref in self.pending for ref in refs)

    def consume(self, refs, step: float) -> None:
        for ref in refs:
            for key in self.pending.pop(ref, ()):
                self.timeline.buffers[key][1] = step
                self.timeline.reads.append((step, key))

    def hand_over(self, ref, size: int, step: float, summed: bool = False) -> bool:
        """Ends the one pending gradient of ``ref`` as the step starts, where it has
        ``size`` bytes: the step's kernel writes its result into that buffer (see
        :data:`.ops.GRADIENT_WRITES_INTO_INCOMING`).  With ``summed``, several
        contributions of that size are summed into the first one's buffer (an ``AddN``
        forwards its input), which is then handed over: a variable read by several
        products (tied weights).  False where a contribution has another size, or there
        are several without ``summed``."""
        keys = self.pending.get(ref, ())
        if not keys or (len(keys) > 1 and not summed) or any(
                self.timeline.buffers[key][2] != size for key in keys):
            return False
        self.pending.pop(ref)
        for key in keys:  # several: summed into the first (an AddN), which is handed over
            self.timeline.buffers[key][1] = step - 0.5  # freed before the step allocates
            self.timeline.reads.append((step, key))
        return True

    def sum_since(self, first: int) -> None:
        """Sums, per tensor, the contributions made since key number ``first`` (one
        step's ``tf.gradients`` call, which returns one gradient per input): they are held
        until the last of them is made, then one buffer of their sum replaces them.  Held
        apart, a kept tensor read by three ops of each of eight overlapping steps counted
        24 gradients where the steps held 8."""
        buffers = self.timeline.buffers
        # only the tensors given a gradient since ``first``: every x's gradient waits to
        # the end, and looking at all of them made each step cost the graph's size
        since = bisect.bisect_left(self._added_at, first)
        touched = dict.fromkeys(self._added[since:])
        for ref in touched:
            keys = self.pending.get(ref)
            if keys is None:
                continue
            new = [key for key in keys if key[1] >= first]
            if len(new) < 2:
                continue
            rows = [buffers[key] for key in new]
            summed = max(row[0] for row in rows)
            for row in rows:
                row[1] = summed
            key = ("grad", self.count)
            self.count += 1
            self.timeline.alloc(key, _sum_bytes(rows), summed)
            _sum_in_place(ref, rows, summed)
            self.pending[ref] = [k for k in keys if k[1] < first] + [key]

    def finish(self, keep: bool = True, results=None) -> None:
        """Gradients never consumed (those of xs): fetched (kept to the end) or used at once.

        An x read by several ops (a weight shared by the steps of an unrolled loop)
        gets one gradient from each; ``tf.gradients`` sums them when the last is made,
        so every one is held until then, and the sum is what is fetched or used.
        ``results``: refs of the tensors whose gradients are the results (all, if
        None); the others (a ``stop_gradients`` tensor's) are read by nothing."""
        for ref, keys in self.pending.items():
            fetched = keep and (results is None or ref in results)
            buffers = [self.timeline.buffers[key] for key in keys]
            summed = max(buffer[0] for buffer in buffers)
            for buffer in buffers:
                buffer[1] = summed
            if len(buffers) == 1:
                buffers[0][1] = _END if fetched else summed
            elif fetched:
                self.timeline.alloc(("sum", ref), _sum_bytes(buffers), summed)
                self.timeline.buffers[("sum", ref)][1] = _END
                _sum_in_place(ref, buffers, summed)


def _sum_in_place(ref, rows, summed: float) -> None:
    """A variable's gradient contributions of one size (tied weights' products) are
    summed into the first one's buffer, as TensorFlow's kernels forward it: that buffer
    ends as the sum is made (three weights each read by two products of [2048, 2048]:
    one 16 MB gradient high).  Only a variable's: where other tensors' contributions
    were summed so, a ``tf.recompute_grad`` model's peak was predicted 17% low."""
    tensor = ref.deref() if hasattr(ref, "deref") else None
    if tensor is None or not (tensor.dtype == tf.resource
                              or tensor.op.type in op_types.VARIABLE_READS):
        return
    if len({row[2] for row in rows}) == 1:
        rows[0][1] = summed - 0.5


def _sum_bytes(buffers) -> int:
    """The bytes of the sum of gradient contributions (timeline rows): one's, where all
    have one size; else all of theirs (parts of different shapes: an upper bound)."""
    sizes = {buffer[2] for buffer in buffers}
    return sizes.pop() if len(sizes) == 1 else sum(buffer[2] for buffer in buffers)


def _backward_op(op, step, timeline, grads, region, xs_refs, size, memo, rename=lambda k: k):
    """One op's gradient: reads what it needs, consumes its outputs' gradients, emits its inputs'.

    ``memo`` (a dict per region and xs) remembers, per op, what its gradient
    reads and which inputs get a gradient of what size.
    """
    found = memo.get(op)
    if found is None:
        wanted = graph_lib.needs_gradient_in(region, xs_refs)
        reads_in, reads_out = graph_lib.gradient_reads(op, wanted)
        arguments = graph_lib.custom_gradient_arguments(op)
        differentiated = op.inputs if arguments is None else arguments
        if graph_lib.blocks_gradients(op):
            differentiated = ()  # StopGradient, Shape: its inputs get no gradient from it
        found = (
            [t.ref() for t in list(reads_in) + list(reads_out)]
            + ([_loop_key(op), _loop_zeros_key(op)] if op.type in graph_lib.WHILE_OP_TYPES else [])
            + ([_kept_key(op.outputs[0].ref())] if size.kept_for_gradient(op) else []),
            [t.ref() for t in op.outputs],
            [(t.ref(), _gradient_size(t, op, size)) for t in differentiated
             if graph_lib.carries_gradient(t) and wanted(t)],
        )
        memo[op] = found
    reads, outputs, emitted = found
    if not grads.has_any(outputs):
        return False  # no gradient reaches it (a custom gradient's inner ops): not differentiated
    if op.type in op_types.GRADIENT_PASSED_ON_AS_IS and len(outputs) == 1 and len(emitted) == 1:
        # the incoming gradient itself: an IndexedSlices (a gathered table's) stays one
        incoming = grads.pending_bytes(outputs[0])
        emitted = [(emitted[0][0], min(emitted[0][1], incoming))]
    unpaired = _kept_unpaired(op, rename, size)
    for ref in reads:
        if unpaired and ref.__class__ is tuple and ref[0] == "kept":
            continue  # the kernel cannot read it: the operands come from different ops
        timeline.use(rename(ref), step)
    if unpaired:
        _scratch(timeline, workspace.max_pool_gradient_bytes(op, size), step)
        # TensorFlow's kernel writes its result into its first operand's buffer where
        # nothing else holds it: freed as the step starts, unless a later step reads it
        root = timeline.alias.get(rename(op.inputs[0].ref()))
        if root is not None and timeline.buffers[root][1] == step:
            timeline.buffers[root][1] = step - 0.5
    if (op.type in _GRADIENT_TAKES_INCOMING_BUFFER and len(outputs) == 1
            and len(emitted) == 1):
        # several products of one variable read: their weight gradients are summed into
        # the first (measured; elsewhere a sum was not seen to forward, so not assumed)
        grads.hand_over(outputs[0], emitted[0][1], step,
                        summed=op.type in op_types.VARIABLE_READS)
    grads.consume(outputs, step)
    for ref, nbytes in emitted:
        grads.add(ref, nbytes, step)
    _scratch(timeline, size.scratch(op, gradient=True), step)
    timeline.executed[step] = (op, "backward")
    return True


def _kept_unpaired(op: tf.Operation, rename, size) -> bool:
    """Whether ``op`` keeps something for its gradient (a oneDNN max pool's workspace)
    that its gradient cannot use here: its output was kept while its input is recomputed,
    so the gradient's operands come from two ops, and TensorFlow runs its own kernel
    (:func:`.workspace.max_pool_gradient_bytes`)."""
    if not size.kept_for_gradient(op):
        return False
    source, output = op.inputs[0].ref(), op.outputs[0].ref()
    return rename(source) is not source and rename(output) is output


def _kept_key(output_ref) -> tuple:
    """The timeline's key for what an op's kernel keeps for its gradient beside its
    outputs (:func:`.workspace.kept_for_gradient_bytes`), by its first output's key (a
    recomputed copy's is renamed with it)."""
    return ("kept", output_ref)


def _loop_key(op: tf.Operation) -> tuple:
    """The timeline's key for what a while loop keeps for its gradient (never renamed:
    a loop is not recomputed)."""
    return ("loop", op.name)


def _loop_zeros_key(op: tf.Operation) -> tuple:
    """The timeline's key for the zeros a while loop's gradient writes (never renamed)."""
    return ("loop zeros", op.name)


def _backward_memo(size: Sizer, region, xs_refs) -> dict:
    """The per-op memo of :func:`_backward_op` for this region and xs, kept by the ``Sizer``."""
    return size.per_region(region, frozenset(xs_refs), dict)


def predict_baseline(
    region: graph_lib.ForwardRegion,
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    unknown_dim: int = 1,
    fetched: bool = True,
    sizer: Sizer | None = None,
    timed: bool = False,
) -> Prediction:
    """Predicted peak of plain ``tf.gradients`` over the region.

    ``fetched``: the gradients of xs stay to the end of the step (fetched);
    otherwise each is used as soon as it is made (e.g. by an optimizer's update).
    ``timed``: also work out :attr:`Prediction.timed_seconds`.
    """
    size = sizer or Sizer(unknown_dim)
    timeline, step = _forward_timeline(region, size)
    grads = _Gradients(timeline)
    xs_refs = {x.ref() for x in xs}
    memo = _backward_memo(size, region, xs_refs)
    for y in ys:
        grads.add(y.ref(), size(y), step)
    for op in reversed(region.order):
        step += 1
        _backward_op(op, step, timeline, grads, region, xs_refs, size, memo)
    grads.finish(fetched)
    forward_work = sum(size.cost(op) for op in region.order)
    forward_seconds, backward_seconds = step_seconds(region, size)
    return Prediction(timeline.peak(step + 1), forward_work, size.assumptions(),
                      forward_seconds=forward_seconds, backward_seconds=backward_seconds,
                      timed_seconds=timed_seconds(timeline, size, step + 1) if timed else 0.0)


def predict_checkpointed(
    region: graph_lib.ForwardRegion,
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    checkpoints: Sequence[tf.Tensor],
    unknown_dim: int = 1,
    fetched: bool = True,
    sizer: Sizer | None = None,
    stops: Sequence[tf.Tensor] = (),
    schedule: schedule_lib.Schedule | None = None,
    timed: bool = False,
) -> Prediction:
    """Predicted peak of :func:`checkpointing.gradients` with these checkpoints and
    ``stop_gradients=stops`` (see :func:`predict_baseline` for ``fetched`` and ``timed``; ``sizer``
    shares sizes between predictions; ``schedule``: their backward schedule, when
    already worked out).  The backward pass takes the steps of
    :func:`.schedule.backward_schedule`, as the rewrite does."""
    size = sizer or Sizer(unknown_dim)
    replay = _replayed(region, ys, xs, checkpoints, size, fetched, stops, schedule)
    forward_work = sum(size.cost(op) for op in region.order)
    forward_seconds, backward_seconds = step_seconds(region, size)
    return Prediction(
        replay.timeline.peak(replay.step + 1), forward_work, size.assumptions(),
        tuple(replay.recomputed.most_common()), forward_seconds, backward_seconds,
        replay.recompute_seconds, replay.repeated_backward_seconds(),
        timed_seconds(replay.timeline, size, replay.step + 1) if timed else 0.0,
    )


@dataclasses.dataclass(frozen=True)
class StepOrder:
    """What the rewrite's ordering waits may leave free, by the memory model.

    ``late``: the gated products that may wait late, without raising the predicted
    peak (see :class:`.rewrite.GradientGates`).  A *gated product* is a recomputed
    product (``MatMul``, ``Conv2D``, ...; :data:`.ops.GRADIENT_READS_OTHER_INPUT`)
    of a recomputed tensor and one that is not (a weight): the gradient for the
    weight reads the recomputed tensor, the one for the recomputed tensor does not.
    Waiting late, its gradients may run as late as the next gated product's
    gradients, so what they read (the recomputed input, its output's gradient) is
    counted as held until then.  In backward order each is let wait late where that
    extra holding keeps the timeline at or under the peak with every gate waiting on
    its own gradients (which :func:`predict_checkpointed` gives).  Each entry is
    ``((step index, position in the step's segment ops), (the same of its pair))``,
    in backward order.  ``headroom``: per recomputed step's
    index, the bytes that may stay live across its recomputation and gradients
    beyond what the model holds there, with the timeline still :data:`LATE_HEADROOM` under its
    peak (the late holds counted): gradient ops that read nothing recomputed may
    run before the recomputation where their outputs fit it
    (:func:`.graph.early_gradient_ops`).
    """

    late: tuple = ()
    headroom: dict = dataclasses.field(default_factory=dict)
    tolerance: int = 0  # bytes early ops may add beyond the headroom: the model's error margin


def step_order(
    region: graph_lib.ForwardRegion,
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    checkpoints: Sequence[tf.Tensor],
    unknown_dim: int = 1,
    stops: Sequence[tf.Tensor] = (),
    schedule: schedule_lib.Schedule | None = None,
) -> StepOrder:
    """The :class:`StepOrder` of the checkpointed pass: one replay, its gates released."""
    replay = _replayed(region, ys, xs, checkpoints, Sizer(unknown_dim), True, stops,
                       schedule, gates=True)
    late = replay.release_late()
    live = replay.timeline.live(replay.step + 1)
    peak = int(live.max()) if len(live) else 0
    return StepOrder(late, replay.recompute_headroom(), int(LATE_HEADROOM * peak))


def _replayed(region, ys, xs, checkpoints, size, fetched, stops, schedule, gates=False):
    """The :class:`_Replay` of a checkpointed pass, every step taken."""
    timeline, step = _forward_timeline(region, size)
    grads = _Gradients(timeline)
    xs_refs = {x.ref() for x in xs}
    memo = _backward_memo(size, region, xs_refs)
    if schedule is None:
        schedule = schedule_lib.backward_schedule(region, ys, xs, checkpoints, stops)
    for y in ys:
        grads.add(y.ref(), size(y), step)
    replay = _Replay(timeline, grads, region, xs_refs, size, memo, step, gates,
                     schedule.read_kept)
    for backward_step in schedule.steps:
        # as the rewrite: a step runs when a gradient reaches one of its targets, and
        # builds nothing when none of its gradients reaches an x
        if any(grads.has(t) for t in backward_step.targets) and backward_step.inputs:
            replay.take(backward_step)
    grads.finish(fetched, xs_refs)
    return replay


#: How far under the predicted peak (a share of it) the timeline must stay where a
#: gated product waits late: the model's error near its peak.  Measured on
#: ResNet-146 at batch 32 ('memory', predicted 50.4 MB, measured 47.9): a limit of
#: the peak itself let the measured peak rise to 48.8 MB in 2 of 4 runs, 5% under
#: it kept 47.9 MB in every run.
LATE_HEADROOM = 0.05


class _Replay:
    """The backward steps of a checkpointed pass on a timeline: recomputations and gradients."""

    def __init__(self, timeline, grads, region, xs_refs, size, memo, step, gates=False,
                 read_kept=frozenset()):
        self.timeline, self.grads, self.region = timeline, grads, region
        self.read_kept = read_kept
        self.xs_refs, self.size, self.memo = xs_refs, size, memo
        self.step = step  # the last step taken
        self.gates = [] if gates else None  # gated products: (key, step, buffers read)
        self.recompute_seconds = 0.0  # the planner's cost of the copies (Sizer.cost)
        self.recomputed: collections.Counter = collections.Counter()
        self.windows: dict = {}  # recomputed step's index -> its (first, last) timeline step
        self.differentiated: collections.Counter = collections.Counter()  # op -> times

    def take(self, backward_step) -> None:
        """One step: its segment's recomputation, if recomputed, then its ops' gradients."""
        segment, index = backward_step.segment, backward_step.index
        recompute = backward_step.handling == schedule_lib.RECOMPUTED
        # the copies that run; the outputs of the others that a gradient reads are kept
        inside = self._running(segment.ops) if recompute else set()

        def rename(ref):
            if ref.__class__ is tuple:
                if ref[0] == "kept":  # what a kernel keeps for its gradient (_kept_key)
                    return ("kept", rename(ref[1]))
                return ref  # a loop's kept iterations (_loop_key): never recomputed
            return (index, ref) if ref.deref().op in inside else ref

        if recompute:
            first = self.step + 1
            self._recompute(segment.ops, index, rename, inside)
        position = {op: i for i, op in enumerate(segment.ops)} if recompute else {}
        first_gradient = self.grads.count
        for op in reversed(segment.ops):
            self.step += 1
            if self.gates is not None and recompute and self._is_gated_product(op, inside):
                self._note_gate((index, position[op]), op, rename)
            if _backward_op(op, self.step, self.timeline, self.grads, self.region,
                            self.xs_refs, self.size, self.memo, rename):
                self.differentiated[op] += 1
        if backward_step.handling != schedule_lib.IN_PLACE:
            # one tf.gradients call: it sums the contributions to each of its inputs
            self.grads.sum_since(first_gradient)
        if recompute:  # the recomputation and the gradients: an early op may span both
            self.windows[index] = (first, self.step)

    def repeated_backward_seconds(self) -> float:
        """The time model's seconds of the gradients taken more than once: an op in the
        segments of two steps (groups that could not be merged) is differentiated by
        each, with its part of the incoming gradient."""
        throughput = timing.current()
        return sum((times - 1) * _gradient_seconds(op, self.size, throughput)
                   for op, times in self.differentiated.items() if times > 1)

    def _is_gated_product(self, op, inside: set) -> bool:
        """A product of a recomputed tensor and one that is not, both needing a gradient."""
        if op.type not in op_types.GRADIENT_READS_OTHER_INPUT or len(op.inputs) != 2:
            return False
        if not all(graph_lib.carries_gradient(t) and (t.op in self.region or t.ref() in self.xs_refs)
                   for t in op.inputs):
            return False
        return sum(t.op in inside for t in op.inputs) == 1

    def _note_gate(self, key, op, rename) -> None:
        """Notes the buffers a gated product's gradients read: its inputs, its outputs'
        gradients."""
        alias = self.timeline.alias
        held = {alias[rename(t.ref())] for t in op.inputs if rename(t.ref()) in alias}
        held.update(k for t in op.outputs for k in self.grads.pending.get(t.ref(), ()))
        self.gates.append((key, self.step, tuple(held)))

    def release_late(self) -> tuple:
        """Lets each gated product but the last wait late where holding what it reads
        until the next one keeps the timeline :data:`LATE_HEADROOM` under its peak (see
        :func:`step_order`); returns the pairs, and the timeline holds them.  Linear in
        the steps: each product's holds lie between its step and the next one's."""
        buffers = self.timeline.buffers
        live = self.timeline.live(self.step + 1)
        limit = (1.0 - LATE_HEADROOM) * (int(live.max()) if len(live) else 0)
        pairs = []
        for (key, step, held), (next_key, next_step, _) in zip(self.gates, self.gates[1:]):
            window = live[step + 1:next_step + 1]  # a view: updated in place when accepted
            extra = np.zeros_like(window)
            for k in held:
                _, end, size = buffers[k]
                if size and end < next_step:
                    extra[max(0, int(end) - step):] += size
            if not extra.any() or (window + extra)[extra > 0].max() <= limit:
                window += extra
                for k in held:
                    buffers[k][1] = max(buffers[k][1], next_step)
                pairs.append((key, next_key))
        return tuple(pairs)

    def recompute_headroom(self) -> dict:
        """Per recomputed step, the bytes its recomputation's window may hold more with
        the timeline :data:`LATE_HEADROOM` under its peak (see :class:`StepOrder`)."""
        live = self.timeline.live(self.step + 1)
        if not len(live):
            return {}
        limit = (1.0 - LATE_HEADROOM) * int(live.max())
        return {index: int(limit - live[first:last + 1].max())
                for index, (first, last) in self.windows.items() if last >= first}

    def _running(self, ops) -> set:
        """:func:`graph.copies_that_run` of a recomputed segment."""
        return graph_lib.copies_that_run(
            ops, graph_lib.needs_gradient_in(self.region, self.xs_refs), self.read_kept,
            self.region.receives_gradient)

    def _recompute(self, ops, index, rename, running) -> None:
        """The copies of ``ops`` that run (``running``), in order."""
        timeline = self.timeline
        for op in ops:
            if op not in running:
                continue  # nothing reads this copy: grappler prunes it
            self.step += 1
            seconds = self.size.cost(op)  # the planner's cost is the time model's seconds
            self.recompute_seconds += seconds
            self.recomputed[op.type] += 1
            timeline.executed[self.step] = (op, "recompute")
            for t in op.inputs:
                timeline.use(rename(t.ref()), self.step)
            for t in op.outputs:
                key = (index, t.ref())
                source = graph_lib.forwarded_input(t)
                if source is not None:
                    timeline.alias_of(key, rename(source.ref()))
                    if key not in timeline.alias:
                        timeline.alloc(key, 0, self.step)
                else:
                    timeline.alloc(key, self.size(t), self.step)
            _note_in_place(timeline, op, self.step, self.size, rename)
            kept = self.size.kept_for_gradient(op)
            if kept:
                timeline.alloc(_kept_key((index, op.outputs[0].ref())), kept, self.step)
            _scratch(timeline, self.size.scratch(op), self.step)

"""The values of small integer tensors that hold shapes, from estimated shapes.

Layer: analysis (read-only, pure); imports: _tensorflow.

A reshape whose target is computed while the step runs (``tf.tensordot``, and so
a Keras 3 ``Dense`` on a ``[batch, seq, d]`` input, reshapes to
``[prod(shape(x)[:-1]), d]``) has an output shape that TensorFlow's static shape
inference leaves unknown, ``[None, None]``, although each dimension follows from
the input's shape.  :func:`evaluate` works such a shape tensor out from the
shapes the memory model estimates for the tensors it reads (``shape_of``): the
ops that build shapes (``Shape``, ``Const``, ``GatherV2``, ``StridedSlice``,
``Prod``, ``Pack``, ``ConcatV2``, ``SplitV``, integer arithmetic and negation,
``Cast``) are evaluated on Python integers, vectors and matrices (a pad's).
Anything else, or a chain longer than ``limit``, is None.
"""

from __future__ import annotations

import operator
from typing import Callable, Union

from ._tensorflow import tf

#: A shape tensor's value: an int (a scalar), a list of ints (a vector), or a list of
#: such lists (a matrix: a pad's ``[[before, after], ...]``).
Value = Union[int, list]

#: Integer ops evaluated elementwise (a scalar broadcast against a vector).
_ARITHMETIC = {
    "Mul": operator.mul,
    "AddV2": operator.add,
    "Add": operator.add,
    "Sub": operator.sub,
    "FloorDiv": operator.floordiv,
    "Maximum": max,
    "Minimum": min,
}

#: The ops that pass their input's value through.
_PASS_THROUGH = frozenset({"Identity", "Cast", "Squeeze", "Reshape", "PlaceholderWithDefault"})


def evaluate(tensor: tf.Tensor, shape_of: Callable[[tf.Tensor], list | None],
             cache: dict | None = None, limit: int = 32) -> Value | None:
    """The value of the integer tensor ``tensor`` (a scalar or a vector), where it
    follows from constants and from ``shape_of(t)``, the (estimated) dimensions of
    the tensors whose ``Shape`` it reads; None where it does not."""
    cache = {} if cache is None else cache
    return _value(tensor, shape_of, cache, limit)


def _value(tensor, shape_of, cache, depth) -> Value | None:
    key = id(tensor)
    found = cache.get(key)
    if found is not None and found[0] is tensor:
        return found[1]
    value = None
    if depth > 0 and tensor.dtype in (tf.int32, tf.int64):
        try:
            value = _computed(tensor, shape_of, cache, depth - 1)
        except (TypeError, ValueError, IndexError, ZeroDivisionError):
            value = None
    cache[key] = (tensor, value)
    return value


def _computed(tensor, shape_of, cache, depth) -> Value | None:
    static = tf.get_static_value(tensor)
    if static is not None:
        return static.tolist()
    op = tensor.op

    def value_of(i):
        return _value(op.inputs[i], shape_of, cache, depth)

    if op.type == "Shape":
        dims = shape_of(op.inputs[0])
        return None if dims is None or None in dims else [int(d) for d in dims]
    if op.type == "Size":
        dims = shape_of(op.inputs[0])
        return None if dims is None or None in dims else _product(dims)
    if op.type in _PASS_THROUGH:
        return _as_rank(value_of(0), tensor.shape.rank)
    if op.type in ("SplitV", "Split"):
        return _split_part(op, tensor.value_index, value_of)
    if op.type == "GatherV2":
        params, indices, axis = value_of(0), value_of(1), value_of(2)
        if not isinstance(params, list) or axis not in (0, -1):
            return None
        if isinstance(indices, list):
            return [params[i] for i in indices]
        return params[indices] if isinstance(indices, int) else None
    if op.type == "StridedSlice":
        return _strided_slice(op, value_of(0), value_of(1), value_of(2), value_of(3))
    if op.type in ("Prod", "Sum"):
        values = value_of(0)
        if isinstance(values, int):
            return values
        if not isinstance(values, list):
            return None
        return _product(values) if op.type == "Prod" else sum(values)
    if op.type == "Pack":
        parts = [value_of(i) for i in range(len(op.inputs))]
        if op.get_attr("axis") != 0:
            return None
        if all(isinstance(p, int) for p in parts):
            return parts
        # rows: a pad's [[before, after]] (``tf.signal.frame`` with ``pad_end``)
        return parts if all(_is_row(p) and len(p) == len(parts[0]) for p in parts) else None
    if op.type == "ConcatV2":
        parts = [value_of(i) for i in range(len(op.inputs) - 1)]
        axis = value_of(len(op.inputs) - 1)
        if not all(isinstance(p, list) for p in parts):
            return None
        vectors = all(not p or isinstance(p[0], int) for p in parts)
        if axis != 0 and not (vectors and axis == -1):
            return None  # a matrix's columns: not worked out
        return [d for p in parts for d in p]
    if op.type in _ARITHMETIC:
        return _elementwise(_ARITHMETIC[op.type], value_of(0), value_of(1))
    if op.type == "Neg":  # -(-n // k): a division rounded up (``tf.signal.frame``)
        value = value_of(0)
        if isinstance(value, int):
            return -value
        return [-v for v in value] if _is_row(value) else None
    return None


def _is_row(value) -> bool:
    """Whether ``value`` is a vector of ints."""
    return isinstance(value, list) and all(isinstance(v, int) for v in value)


def _as_rank(value: Value | None, rank: int | None) -> Value | None:
    """``value`` as a scalar (rank 0) or a vector (rank 1), where a reshape or a
    squeeze turned one element's vector into a scalar or back."""
    if rank == 0 and isinstance(value, list):
        return value[0] if len(value) == 1 else None
    if rank == 1 and isinstance(value, int):
        return [value]
    return value


def _split_part(op: tf.Operation, index: int, value_of) -> Value | None:
    """Part ``index`` of a vector split along its only axis: ``SplitV``'s sizes (one
    of them -1: what the others leave), or ``Split``'s equal parts.  ``tf.signal.frame``
    splits a signal's shape into its outer dimensions, its length and the rest."""
    if op.type == "SplitV":
        values, sizes, axis = value_of(0), value_of(1), value_of(2)
    else:
        axis, values, sizes = value_of(0), value_of(1), None
    if not isinstance(values, list) or axis not in (0, -1):
        return None
    if sizes is None:
        count = len(op.outputs)
        if len(values) % count:
            return None
        sizes = [len(values) // count] * count
    if not isinstance(sizes, list) or len(sizes) != len(op.outputs) or sizes.count(-1) > 1:
        return None
    sizes = list(sizes)  # the cache holds the list: another split may read it
    if -1 in sizes:
        sizes[sizes.index(-1)] = len(values) - sum(s for s in sizes if s != -1)
    start = sum(sizes[:index])
    return values[start:start + sizes[index]]


def _product(values) -> int:
    result = 1
    for v in values:
        result *= int(v)
    return result


def _elementwise(function, a, b) -> Value | None:
    if a is None or b is None:
        return None
    if isinstance(a, int) and isinstance(b, int):
        return function(a, b)
    if isinstance(a, int):
        return [function(a, y) for y in b]
    if isinstance(b, int):
        return [function(x, b) for x in a]
    return [function(x, y) for x, y in zip(a, b)] if len(a) == len(b) else None


def _strided_slice(op, values, begin, end, strides) -> Value | None:
    """``values[begin:end:stride]`` of a vector, with the op's masks (one axis only)."""
    if not isinstance(values, list) or not all(
            isinstance(v, list) and len(v) == 1 for v in (begin, end, strides)):
        return None
    if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
        return None
    start = None if op.get_attr("begin_mask") & 1 else begin[0]
    stop = None if op.get_attr("end_mask") & 1 else end[0]
    if op.get_attr("shrink_axis_mask") & 1:
        return values[start]
    return values[start:stop:strides[0]]


#: An integer as an affine function of integer scalars known only when the step runs:
#: ``{None: constant, tensor ref: coefficient, ...}``.
Affine = dict


def affine(tensor: tf.Tensor, limit: int = 8) -> Affine | list | None:
    """``tensor`` (an integer scalar, or a vector: a list of them) as an affine function
    of the integer scalars the graph computes while it runs, each taken as an unknown:
    ``i * 256`` is ``{i: 256}``, ``(i + 1) * 256`` is ``{i: 256, None: 256}``.  None
    where it is not one (a product of two unknowns, a chain longer than ``limit``)."""
    static = tf.get_static_value(tensor)
    if static is not None:
        value = static.tolist()
        if isinstance(value, int):
            return {None: value}
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            return [{None: v} for v in value]
        return None
    if limit <= 0 or tensor.dtype not in (tf.int32, tf.int64):
        return None
    op = tensor.op
    if op.type in ("Identity", "Cast"):
        return affine(op.inputs[0], limit - 1)
    if op.type == "Pack":
        parts = [affine(t, limit - 1) for t in op.inputs]
        return parts if all(isinstance(p, dict) for p in parts) else None
    if op.type in ("Add", "AddV2", "Sub", "Mul"):
        a, b = (affine(t, limit - 1) for t in op.inputs[:2])
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return None
        if op.type == "Mul":
            if set(a) <= {None}:
                a, b = b, a
            if not set(b) <= {None}:
                return None  # a product of two unknowns
            return {key: c * b.get(None, 0) for key, c in a.items()}
        sign = -1 if op.type == "Sub" else 1
        summed = dict(a)
        for key, c in b.items():
            summed[key] = summed.get(key, 0) + sign * c
        return summed
    if tensor.shape.rank == 0:
        return {tensor.ref(): 1}
    return None


def constant_difference(end: Affine, begin: Affine) -> int | None:
    """``end - begin`` where it is the same whatever the unknowns are; else None."""
    keys = set(end) | set(begin)
    if any(end.get(k, 0) != begin.get(k, 0) for k in keys if k is not None):
        return None
    return end.get(None, 0) - begin.get(None, 0)

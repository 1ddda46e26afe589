"""Kernel workspaces: bytes a kernel allocates besides its outputs, freed when it returns.

Layer: analysis (read-only, pure); imports: ops, _tensorflow (whether oneDNN is on).

The memory model counts each op's outputs from the step that makes them; a
kernel that copies its operands into scratch buffers holds more while it runs.
:func:`forward_bytes` and :func:`gradient_bytes` give that transient for an op
and for the kernels of its registered gradient; the model adds it at the op's
step only.

A oneDNN max pool writes where each maximum lay into a byte per output element.
``Einsum`` is modelled after TensorFlow's CPU (and oneDNN) kernel
(``EinsumHelper`` in ``einsum_op_impl.h``): it transposes each operand whose
axes are not already in the order [broadcast, batch, free, contract] (or with
free and contract swapped, which the batched product takes as a transpose
flag) into a temporary, and when the product's axes are not in the output's
order it writes the product into a temporary and transposes it into the
output.  In multi-head attention at batch 32 the two gradient einsums of the
value product allocated 2 MB each beyond their outputs of 2 and 1 MB
(measured from the allocator's records), which is what this rule gives.
Repeated labels (diagonals) and reductions allocate smaller temporaries,
counted where the dimensions are known.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from . import ops as op_types
from ._tensorflow import onednn_enabled, tf

# EinsumHelper's dimension types, in the order the kernel sorts operand axes by.
_BROADCAST, _BATCH, _FREE, _CONTRACT, _REDUCE = range(5)
# The order with free and contract swapped (the product then transposes the operand).
_SWAPPED_RANK = (0, 1, 3, 2, 4)
_ELLIPSIS = "..."
#: The block of a first operand read transposed that oneDNN's matrix product packs into
#: its scratchpad: at most this many rows by this many contracted elements (measured on
#: an AVX-512 CPU, float32: 'ik,ij->kj' packed k x i floats for k = 384, i = 512;
#: 384 x 512 for i = 1024; 512 x 512 for k = 768; 'abd,abc->cd' d x 512 for a x b = 2048).
ONEDNN_PACKED_BLOCK = 512


def _subscripts(part: str, rank: int | None) -> list[str] | None:
    """A subscript's labels, its ellipsis expanded to ``rank`` minus the named labels
    (broadcast labels ``'.0'``, ``'.1'``, ... from the left, as the kernel numbers
    them); None where the rank it needs is unknown."""
    if _ELLIPSIS not in part:
        return list(part)
    before, after = part.split(_ELLIPSIS)
    if rank is None:
        return None
    count = rank - len(before) - len(after)
    if count < 0:
        return None
    return list(before) + [f".{i}" for i in range(count)] + list(after)


def parse_equation(equation: str, ranks: Sequence[int | None]) -> tuple | None:
    """``(inputs' labels, output's labels)`` of an einsum equation with its ellipses
    expanded for operands of these ranks; None where that needs an unknown rank or
    the equation has no explicit output."""
    equation = equation.replace(" ", "")
    if "->" not in equation:
        return None
    left, output = equation.split("->")
    parts = left.split(",")
    if len(parts) != len(ranks):
        return None
    inputs = [_subscripts(part, rank) for part, rank in zip(parts, ranks)]
    if any(labels is None for labels in inputs):
        return None
    widest = max((sum(label.startswith(".") for label in labels) for labels in inputs), default=0)
    outputs = _subscripts(output, len(output.replace(_ELLIPSIS, "")) + widest)
    return inputs, outputs


def _label_types(inputs: list[list[str]], output: list[str]) -> dict[str, int]:
    types = {}
    for labels in inputs:
        for label in labels:
            if label.startswith("."):
                types[label] = _BROADCAST
                continue
            removed = label not in output
            unique = len(inputs) == 1 or sum(label in other for other in inputs) == 1
            types[label] = ((_CONTRACT if not unique else _REDUCE) if removed
                            else (_BATCH if not unique else _FREE))
    return types


@dataclasses.dataclass(frozen=True)
class EinsumScratch:
    """What TensorFlow's einsum kernel does with an equation's operands and product.

    ``transposed``: per operand, whether it is copied into a transposed temporary;
    ``reduced``: per operand, the labels it sums over first (into a smaller
    temporary); ``swapped``: per operand, whether the batched product reads it
    transposed instead; ``batched``: whether the product has batch (or broadcast)
    axes; ``output_transposed``: whether the product is written to a temporary and
    transposed into the output."""

    transposed: tuple
    reduced: tuple
    swapped: tuple
    batched: bool
    contracted: frozenset
    output_transposed: bool


def einsum_scratch(inputs: list[list[str]], output: list[str]) -> EinsumScratch:
    """The :class:`EinsumScratch` of an equation's labels (:func:`parse_equation`)."""
    types = _label_types(inputs, output)
    # integer labels in the kernel's numbering: first appearance, inputs then output
    number = {}
    for label in [label for labels in inputs for label in labels] + output:
        if not label.startswith("."):
            number.setdefault(label, len(number))
    named = len(number)
    for label in {label for labels in inputs for label in labels if label.startswith(".")}:
        number[label] = named + int(label[1:])
    transposed, reduced, swapped, free_labels = [], [], [], []
    for labels in inputs:
        keys = [(types[label], number[label]) for label in labels]
        swapped_keys = [(_SWAPPED_RANK[kind], n) for kind, n in keys]
        swap = all(a <= b for a, b in zip(swapped_keys, swapped_keys[1:]))
        order = list(labels) if swap else [
            labels[i] for i in sorted(range(len(labels)), key=lambda i: keys[i])]
        swapped.append(swap)
        transposed.append(len(labels) >= 2 and order != list(labels))
        reduced.append(frozenset(label for label in labels if types[label] == _REDUCE))
        deduped = [label for i, label in enumerate(order) if i == 0 or order[i - 1] != label]
        free_labels.append([label for label in deduped if types[label] == _FREE])
    leading = sorted((label for label in types if types[label] in (_BROADCAST, _BATCH)),
                     key=lambda label: (types[label], number[label]))
    result = leading + [label for labels in free_labels for label in labels]
    contracted = frozenset(label for label in types if types[label] == _CONTRACT)
    return EinsumScratch(tuple(transposed), tuple(reduced), tuple(swapped), bool(leading),
                         contracted, len(inputs) == 2 and len(output) >= 2 and result != output)


def _einsum_bytes(equation: str, operands: Sequence[tf.Tensor], result_bytes: int,
                  size: Callable[[tf.Tensor], int],
                  shape: Callable[[tf.Tensor], list | None], onednn: bool) -> int:
    """Scratch bytes of one einsum kernel over these operands, making ``result_bytes``.

    The operands' transposed (and reduced) copies live through the kernel; then
    either the product's temporary (when it is transposed into the output) or,
    under oneDNN, the matrix product's scratchpad: for an unbatched product that
    reads its first operand transposed, oneDNN packs a block of that operand
    (:data:`ONEDNN_PACKED_BLOCK`), and frees the scratchpad before the output is
    transposed.
    """
    ranks = [t.shape.rank for t in operands]
    parsed = parse_equation(equation, ranks)
    if parsed is None:
        return 0
    inputs, output = parsed
    scratch = einsum_scratch(inputs, output)
    copies = 0
    for operand, labels, copy, summed in zip(operands, inputs, scratch.transposed, scratch.reduced):
        nbytes = size(operand)
        copies += nbytes if copy else 0
        if summed:
            dims = shape(operand) or []
            known = [dims[i] for i, label in enumerate(labels)
                     if label in summed and i < len(dims) and dims[i]]
            copies += nbytes // max(1, math.prod(known)) if known else 0
    product = result_bytes if scratch.output_transposed else 0
    packed = 0
    if onednn and len(operands) == 2 and scratch.swapped[0] and not scratch.batched:
        packed = size(operands[0])
        dims = shape(operands[0]) or []
        if len(dims) == len(inputs[0]) and all(dims):
            depth = math.prod(d for d, label in zip(dims, inputs[0]) if label in scratch.contracted)
            rows = math.prod(dims) // max(1, depth)
            packed = min(packed, operands[0].dtype.size * min(rows, ONEDNN_PACKED_BLOCK)
                         * min(depth, ONEDNN_PACKED_BLOCK))
    return copies + max(product, packed)


def _equation(op: tf.Operation) -> str | None:
    try:
        equation = op.get_attr("equation")
    except (ValueError, TypeError):
        return None
    return equation.decode() if isinstance(equation, bytes) else equation


def forward_bytes(op: tf.Operation, size: Callable[[tf.Tensor], int],
                  shape: Callable[[tf.Tensor], list | None]) -> int:
    """Scratch bytes ``op``'s kernel holds while it runs (0 for an op not modelled)."""
    if op.type != "Einsum" or not op.outputs:
        return 0
    equation = _equation(op)
    if equation is None:
        return 0
    return _einsum_bytes(equation, list(op.inputs), size(op.outputs[0]), size, shape,
                         onednn_enabled())


def kept_for_gradient_bytes(op: tf.Operation, size: Callable[[tf.Tensor], int]) -> int:
    """Bytes ``op``'s kernel allocates besides its outputs and keeps for its gradient: a
    oneDNN max pool's workspace, one byte per output element (where the index of each
    maximum is), which its gradient (``MaxPoolGrad``) reads.  A pool whose output no
    gradient reads frees it as the kernel returns.  Measured: six 1 MiB workspaces beside
    4 MiB outputs live at plain's peak, until each pool's gradient (0 where not modelled)."""
    if _pools_with_onednn(op):
        output = op.outputs[0]
        return size(output) // max(1, output.dtype.size)
    return 0


def _pools_with_onednn(op: tf.Operation) -> bool:
    return (op.type in op_types.ONEDNN_MAX_POOLS and bool(op.outputs) and onednn_enabled()
            and op.outputs[0].dtype in (tf.float32, tf.bfloat16))


def max_pool_gradient_bytes(op: tf.Operation, size: Callable[[tf.Tensor], int]) -> int:
    """Scratch of a max pool's gradient where it has no oneDNN workspace to read
    (oneDNN off, another dtype, or a pool whose output was kept while its input is
    recomputed: the gradient's two operands then come from different ops): TensorFlow's
    own ``MaxPoolGrad`` finds each maximum again, into an int64 index per output element
    (measured: 8 MiB beside a 4 MiB output, 2 MiB beside 1 MiB at stride 2)."""
    if op.type not in op_types.ONEDNN_MAX_POOLS or not op.outputs:
        return 0
    output = op.outputs[0]
    return 8 * (size(output) // max(1, output.dtype.size))


def gradient_bytes(op: tf.Operation, size: Callable[[tf.Tensor], int],
                   shape: Callable[[tf.Tensor], list | None]) -> int:
    """Scratch bytes of the kernels of ``op``'s gradient, which the model runs in one
    step (0 for an op not modelled).

    TensorFlow's gradient of a two-operand einsum ``x,y->z`` is the einsums
    ``z,y->x'`` and ``z,x->y'`` (``x'``: ``x`` without the labels only it has; an
    ellipsis in ``z`` is given to both operands, their broadcast axes summed after);
    the incoming gradient has ``z``'s shape.
    """
    if op.type in BROADCASTING_PRODUCTS:
        return _broadcast_product_gradient_bytes(op, shape)
    if op.type in op_types.ONEDNN_MAX_POOLS and not _pools_with_onednn(op):
        return max_pool_gradient_bytes(op, size)
    if op.type != "Einsum" or len(op.inputs) != 2 or not op.outputs:
        return 0
    equation = (_equation(op) or "").replace(" ", "")
    if "->" not in equation:
        return 0
    parts, out = equation.split("->")
    x_subs, y_subs = parts.split(",")
    if _ELLIPSIS in out:
        x_subs += "" if _ELLIPSIS in x_subs else _ELLIPSIS
        y_subs += "" if _ELLIPSIS in y_subs else _ELLIPSIS
    x, y = op.inputs
    gradient = op.outputs[0]
    onednn = onednn_enabled()
    total = 0
    for own, own_subs, other, other_subs in ((x, x_subs, y, y_subs), (y, y_subs, x, x_subs)):
        keep = set(out + other_subs)
        head, _, tail = own_subs.partition(_ELLIPSIS)
        kept = ("".join(c for c in head if c in keep)
                + (_ELLIPSIS if _ELLIPSIS in own_subs else "")
                + "".join(c for c in tail if c in keep))
        grad_equation = f"{out},{other_subs}->{kept}"
        result = _result_bytes(grad_equation, [gradient, other], shape)
        total += _einsum_bytes(grad_equation, [gradient, other],
                               size(own) if result is None else result, size, shape, onednn)
    return total


#: Batched matrix products that broadcast their batch dimensions (``tf.matmul`` of a
#: ``[B, T, K]`` activation and a ``[K, N]`` weight, as Keras ``Dense`` on a sequence).
BROADCASTING_PRODUCTS = frozenset({"BatchMatMulV2", "BatchMatMulV3"})


def _broadcast_product_gradient_bytes(op: tf.Operation,
                                      shape: Callable[[tf.Tensor], list | None]) -> int:
    """Scratch of a broadcasting batched product's gradient: TensorFlow's gradient of an
    operand with fewer (or size-1) batch dimensions is the product at the output's batch
    shape (``[B, K, N]`` for a ``[K, N]`` weight), summed over the broadcast dimensions
    after.  Measured: a ``[64, 64, 256] @ [256, 256]`` product's weight gradient
    allocated 16 MB (``64 * 256 * 256`` floats) for a 256 KB result."""
    if len(op.inputs) != 2 or not op.outputs:
        return 0
    out = shape(op.outputs[0])
    if out is None or len(out) < 2:
        return 0
    batch = [d or 1 for d in out[:-2]]
    total = 0
    for own in op.inputs:
        dims = shape(own)
        if dims is None or len(dims) < 2 or not own.dtype.is_floating:
            continue
        own_batch = [d or 1 for d in dims[:-2]]
        padded = [1] * (len(batch) - len(own_batch)) + own_batch
        if padded == batch:
            continue  # no broadcast: the gradient has the operand's own shape
        total += math.prod(batch) * (dims[-2] or 1) * (dims[-1] or 1) * own.dtype.size
    return total


def _result_bytes(equation: str, operands: Sequence[tf.Tensor],
                  shape: Callable[[tf.Tensor], list | None]) -> int | None:
    """Bytes of an einsum's result before any sum over broadcast axes, from its
    operands' dimensions (its labels' sizes); None where one is unknown."""
    parsed = parse_equation(equation, [t.shape.rank for t in operands])
    if parsed is None:
        return None
    inputs, output = parsed
    dims = {}
    for operand, labels in zip(operands, inputs):
        for label, dim in zip(labels, shape(operand) or []):
            if dim is not None and dims.get(label, 1) in (None, 1):
                dims[label] = dim  # a broadcast axis of 1 takes the other operand's size
    if any(dims.get(label) is None for label in output):
        return None
    return operands[0].dtype.size * math.prod(dims[label] for label in output)

"""Read-only analysis of the forward graph.

Layer: analysis (read-only); imports: ops, _tensorflow.

Everything here is a pure function of existing ops and tensors: nothing is
created or changed.  Walks are linear in ops + edges.  Graph tensors are
unhashable inside a ``tf.function``, so sets and dicts of tensors are keyed by
``tensor.ref()``; operations are hashable everywhere.

Topological order: TensorFlow creates an op only after the ops of its inputs,
so an op's creation id (:func:`._tensorflow.op_id`) is a topological order of the data edges
of every op this library may recompute (the exceptions, back edges of v1
``while_loop``s, belong to ops that are never recomputed).  Sorting by it is
deterministic and needs no graph walk.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
import os
import weakref
from typing import Callable, Collection, Hashable, Iterable, Mapping, Sequence

import numpy as np

from . import _tensorflow as _tf_internals
from . import ops as op_types
from ._tensorflow import tf

#: ``needs_gradient(tensor)``: whether a gradient for ``tensor`` is wanted.
NeedsGradient = Callable[[tf.Tensor], bool]

#: :data:`.ops.CONTROL_FLOW` (the name other modules read).
CONTROL_FLOW_OP_TYPES = op_types.CONTROL_FLOW


def op_order(op: tf.Operation) -> int:
    """Creation id of an op: a deterministic topological order (see module doc)."""
    return _tf_internals.op_id(op)


def last_op_id(graph: tf.Graph) -> int:
    """Creation id of the newest op of ``graph`` (0 for an empty graph): see
    :func:`._tensorflow.last_op_id`."""
    return _tf_internals.last_op_id(graph)


def forwards_its_input(op: tf.Operation) -> bool:
    """Whether ``op``'s output is its first input's value unchanged (an identity, a
    reshape to the same static shape, a transpose by the identity permutation):
    grappler may remove it and let its consumers read the input."""
    if not op.inputs or len(op.outputs) != 1:
        return False
    if op.type in op_types.VALUE_FORWARDING or is_identity_transpose(op):
        return True
    if op.type in op_types.SAME_ELEMENTS:
        before, after = op.inputs[0].shape, op.outputs[0].shape
        return before.is_fully_defined() and after.is_fully_defined() and before == after
    return False


def is_identity_transpose(op: tf.Operation) -> bool:
    """Whether ``op`` transposes by the identity permutation (known once its constant
    inputs fold): grappler removes it.  ``tf.tensordot`` makes one where the batch is
    unknown (a Keras 3 ``Dense`` on a ``[batch, seq, d]`` input)."""
    if op.type not in op_types.TRANSPOSES or len(op.inputs) < 2:
        return False
    found = _identity_transposes.get(op)
    if found is None:  # folding the permutation takes 10-60 us: once per op
        perm = tf.get_static_value(op.inputs[1])
        found = _identity_transposes[op] = bool(
            perm is not None and perm.ndim == 1 and list(perm) == list(range(len(perm))))
    return found


#: :func:`is_identity_transpose`'s answers, per transpose op (an op's inputs do not change).
_identity_transposes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shares_input_buffer(op: tf.Operation) -> bool:
    """Whether ``op``'s output holds its first input's buffer, allocating nothing: the
    types of :data:`.ops.ALIASES` (identities, reshapes, variable reads, lists of
    slices) and identity transposes (:func:`is_identity_transpose`); not a variable
    read that copies the variable (:func:`copies_on_read`)."""
    return bool(op.inputs) and (
        (op.type in op_types.ALIASES and not copies_on_read(op)) or is_identity_transpose(op))


def forwarded_input(tensor: tf.Tensor) -> tf.Tensor | None:
    """The input whose buffer ``tensor`` holds (its op allocates nothing for it), or None:
    the first input, for the output of an op that :func:`shares_input_buffer`; input i,
    for output i of an ``IdentityN`` (a ``tf.custom_gradient`` function's op: its
    closure may read a result, which then is the buffer the next layer reads)."""
    op = tensor.op
    if op.type == "IdentityN":
        return op.inputs[tensor.value_index] if tensor.value_index < len(op.inputs) else None
    return op.inputs[0] if tensor.value_index == 0 and shares_input_buffer(op) else None


def copies_on_read(op: tf.Operation) -> bool:
    """Whether a variable read (``ReadVariableOp``) copies the variable's buffer.

    TensorFlow switches a resource variable to copy-on-read for good once an op touches
    it sparsely (:data:`.ops.SPARSE_VARIABLE_ACCESS`, ``ResourceSparseApply*``).  Such an
    op on the same handle may be in the graph already; or every read of the variable
    is the params of row gathers only (an embedding lookup): its gradient is then an
    ``IndexedSlices``, which optimizers (Keras, tf_keras, ``tf.compat.v1.train``) apply
    with a scatter, built after the gradients, so from the second step on every read
    copies.  A table also read densely (an output projection tied to it) gets a dense
    gradient and a dense update: its reads share its buffer.  A read whose value nothing
    uses (Keras' embedding reads its table for a shape that is then known) decides
    nothing: it made a fresh plan say "shares" and the same plan, asked after the
    optimizer's scatter was built, say "copies"."""
    if op.type not in op_types.VARIABLE_READS or not op.inputs:
        return False
    reads = []
    for consumer in op.inputs[0].consumers():
        if (consumer.type in op_types.SPARSE_VARIABLE_ACCESS
                or consumer.type.startswith("ResourceSparseApply")):
            return True
        if consumer.type in op_types.VARIABLE_READS:
            reads.append(consumer.outputs[0])
    verdicts = [v for v in map(_read_only_by_row_gathers, reads) if v is not None]
    return bool(verdicts) and all(verdicts)


def _read_only_by_row_gathers(value: tf.Tensor) -> bool | None:
    """Whether every op that reads ``value`` (through identities, which the rewrite's
    proxies are) is a row gather taking it as params, or reads only its shape, with
    one gather at least; None where nothing reads more than its shape."""
    gathers, pending, seen = 0, [value], set()
    while pending:
        tensor = pending.pop()
        if tensor.ref() in seen:
            continue
        seen.add(tensor.ref())
        for consumer in tensor.consumers():
            if consumer.type in op_types.VALUE_FORWARDING:
                pending.extend(consumer.outputs[:1])
            elif consumer.type in op_types.SHAPE_ONLY_READERS:
                continue
            elif (consumer.type in op_types.GATHERS and gathers_rows(consumer)
                  and consumer.inputs[0].ref() == tensor.ref()):
                gathers += 1
            else:
                return False
    return True if gathers else None


def gathers_rows(op: tf.Operation) -> bool:
    """Whether a gather (:data:`.ops.GATHERS`) takes rows of its params (axis 0): their
    gradient is then an ``IndexedSlices`` of the gathered rows."""
    if op.type != "GatherV2":
        return True
    axis = tf.get_static_value(op.inputs[2])
    return axis is not None and int(axis) == 0


def reads_a_variable(t: tf.Tensor) -> bool:
    """Whether ``t`` is a variable's value (``ReadVariableOp``, or the read of a v1 ref
    variable): grappler never removes an identity of it."""
    if t.op.type in op_types.VARIABLE_READS:
        return True
    return t.op.type == "Identity" and bool(t.op.inputs) and (
        t.op.inputs[0].op.type in op_types.REF_VARIABLES)


def value_root(t: tf.Tensor) -> Hashable:
    """``ref()`` of the tensor whose value ``t`` forwards unchanged (``t`` itself when its
    op computes something): two tensors with the same root are one value once grappler
    has removed the forwarding ops between them."""
    while forwards_its_input(t.op):
        t = t.op.inputs[0]
    return t.ref()


def tensor_order(tensor: tf.Tensor) -> tuple:
    """Deterministic sort key of a tensor: producer's creation id, output index."""
    return (op_order(tensor.op), tensor.value_index)


def builds_for_xla(graph: tf.Graph) -> bool:
    """Whether the ops being added to ``graph`` will be compiled by XLA.

    True at trace time inside a ``tf.function(jit_compile=True)``, in
    functions and loop bodies nested in one, in Keras ``jit_compile=True``
    train steps, and in a v1 graph under ``tf.compat.v1.xla.experimental.compile``
    (all seen by ``control_flow_util.GraphOrParentsInXlaContext``).  Also
    True when auto-clustering is switched on for a device the ops may run on
    (see :func:`auto_clustering_requested`), which nothing in the graph shows.
    """
    if _tf_internals.in_xla_context(graph):
        return True
    flags, jit = os.environ.get("TF_XLA_FLAGS", ""), tf.config.optimizer.get_jit()
    if "tf_xla_auto_jit" not in flags and jit != "autoclustering":
        return False
    return auto_clustering_requested(flags, jit, _tf_internals.gpu_visible())


def auto_clustering_requested(tf_xla_flags: str, jit_setting: str, gpu_visible: bool) -> bool:
    """Whether XLA auto-clustering will cluster ops, from its switches (pure).

    ``tf_xla_flags``: the ``TF_XLA_FLAGS`` environment variable;
    ``jit_setting``: ``tf.config.optimizer.get_jit()``.  Auto-clustering is
    on with ``--tf_xla_auto_jit`` 1, 2, ``fusible`` or ``single-gpu(...)``,
    and, where the flag is 0 or absent, with ``tf.config.optimizer.set_jit(True)``;
    it clusters GPU ops, and CPU ops only with ``--tf_xla_cpu_global_jit``.
    """
    auto = jit_setting == "autoclustering"
    cpu = False
    for token in tf_xla_flags.split():
        name, _, value = token.lstrip("-").partition("=")
        if name == "tf_xla_auto_jit" and value not in ("", "0"):  # 0: as the config says
            auto = value != "-1"
        elif name == "tf_xla_cpu_global_jit":
            cpu = value.lower() not in ("0", "false")
    return auto and (gpu_visible or cpu)


def v1_control_flow_context(op: tf.Operation) -> _tf_internals.ControlFlowContext | None:
    """The outermost v1 ``while_loop``/``cond`` context ``op`` is in, or None.

    XLA contexts are skipped: they are no control flow, but a
    ``tf.function(jit_compile=True)`` traced by ``get_concrete_function`` or
    ``experimental_get_compiler_ir`` puts every op in one.
    """
    context = _tf_internals.control_flow_context(op)
    outermost = None
    while context is not None:
        if not context.IsXLAContext():
            outermost = context
        context = context.outer_context
    return outermost


def is_recomputable(op: tf.Operation) -> bool:
    """Whether running a copy of ``op`` again is guaranteed to give the same result.

    Stateful ops (random draws, variable reads and writes, queues, prints; not the
    checks that pass their input on, :data:`.ops.CHECKS_OF_THEIR_INPUT`),
    ops that draw random numbers from ``seed``/``seed2`` attributes whatever their
    registration says (``FractionalMaxPool`` and ``FractionalAvgPool`` are registered
    stateless, yet with the default seed 0 each kernel draws its own pooling regions:
    a copy pooled other regions than the forward op, and the gradients came out wrong),
    control flow, function calls, ops in a v1 control-flow context, ops on
    reference tensors and ops that make or read a variant (a ``TensorList``, which
    holds tensors whose bytes the memory model cannot see: keeping one to recompute
    from it may hold a whole sequence) are never copied: their outputs are kept
    instead.
    """
    if op.type in op_types.CONTROL_FLOW:
        return False
    if draws_from_seed_attributes(op):
        return False
    if any(t.dtype == tf.variant for t in op.inputs) or any(
            t.dtype == tf.variant for t in op.outputs):
        return False
    if v1_control_flow_context(op) is not None:
        return False
    try:
        if op.op_def.is_stateful and op.type not in op_types.CHECKS_OF_THEIR_INPUT:
            return False
    except (AttributeError, ValueError):  # functions called by name have no OpDef
        return False
    if _tf_internals.is_function_call(op):
        return False
    if any(_tf_internals.is_ref_dtype(t.dtype) for t in op.inputs) or any(
        _tf_internals.is_ref_dtype(t.dtype) for t in op.outputs
    ):
        return False
    return bool(op.inputs)


def draws_from_seed_attributes(op: tf.Operation) -> bool:
    """Whether ``op``'s kernel draws random numbers seeded by its ``seed`` and ``seed2``
    attributes (the op declares both): a second kernel of the same op draws again."""
    try:
        names = {attr.name for attr in op.op_def.attr}
    except (AttributeError, ValueError):  # functions called by name have no OpDef
        return False
    return {"seed", "seed2"} <= names


def custom_gradient_arguments(op: tf.Operation) -> tuple | None:
    """The inputs of a ``tf.custom_gradient`` function's op (graph mode: an ``IdentityN``
    of its results, then its arguments, with a gradient override) that get a gradient:
    its arguments.  Its gradient function is a Python closure that reads them as the
    forward pass made them (``tf.nn.silu`` and swish are such functions); a recomputed
    copy's gradient is made to read their copies where those run
    (:func:`.rewrite.closures_read_copies`).  Its results get None, so the ops that
    computed them are not differentiated.  None for any other op."""
    if op.type != "IdentityN" or not _tf_internals.is_custom_gradient_op(op):
        return None
    return tuple(t for t in op.inputs[_custom_gradient_results(op):] if t.dtype != tf.resource)


def custom_gradient_reads(op: tf.Operation) -> tuple | None:
    """The tensors a ``tf.custom_gradient`` op's gradient function reads: what its Python
    closure holds (the docstring's ``log1pexp`` holds ``tf.exp(x)``, made inside the
    function, and not ``x``; ``tf.nn.silu`` its argument), and the arguments that
    TensorFlow's wrappers hold (``tf.recompute_grad``'s); all its arguments where its
    function is not found.  A recomputed copy's gradient reads their copies where those
    run (:func:`.rewrite.closures_read_copies`).  None for any other op."""
    arguments = custom_gradient_arguments(op)
    if arguments is None:
        return None
    found = _tf_internals.custom_gradient_closure_tensors(op)
    if found is None:
        return arguments
    own, wrappers = found
    argument_refs = {t.ref() for t in arguments}
    reads = {t.ref(): t for t in wrappers if t.ref() in argument_refs}
    reads.update((t.ref(), t) for t in own)
    return tuple(t for t in reads.values() if t.dtype != tf.resource)


def custom_gradient_closure_reads(op: tf.Operation) -> tuple:
    """What :func:`custom_gradient_reads` finds that ``op`` does not take as an input
    (made inside the function); ``()`` for any other op."""
    inputs = {t.ref() for t in op.inputs}
    return tuple(t for t in custom_gradient_reads(op) or () if t.ref() not in inputs)


def _custom_gradient_results(op: tf.Operation) -> int:
    """How many leading inputs of a ``tf.custom_gradient`` ``IdentityN`` are the
    function's results.  The function made them from its arguments, which existed
    before it ran: the least count after which every later input is older than every
    result.  (Which outputs are read is no guide: a gradient built later may read the
    arguments' outputs, e.g. ``zeros_like`` of an unknown shape.)  Where no count
    fits, the leading outputs that are read."""
    orders = [op_order(t.op) for t in op.inputs]
    for results in range(1, len(orders)):
        if max(orders[results:]) < min(orders[:results]):
            return results
    results = 0
    while results < len(op.outputs) and op.outputs[results].consumers():
        results += 1
    return results


def gradient_reads(op: tf.Operation, needs_gradient: NeedsGradient = lambda tensor: True) -> tuple:
    """(inputs, outputs) of ``op`` that its gradient reads, by op type.

    ``needs_gradient(tensor)`` says whether an input's gradient is wanted;
    it decides what products read.
    """
    arguments = custom_gradient_arguments(op)
    if arguments is not None:
        return custom_gradient_reads(op), ()
    reads = _gradient_reads_by_type(op, needs_gradient)
    index = op_types.GRADIENT_ZEROS_LIKE_INPUT.get(op.type)
    if index is not None and len(op.inputs) > index and not op.inputs[index].shape.is_fully_defined():
        return reads[0] + (op.inputs[index],), reads[1]
    return reads


def _gradient_reads_by_type(op: tf.Operation, needs_gradient: NeedsGradient) -> tuple:
    """:func:`gradient_reads` by the op type's set in :mod:`.ops`; ops that read only
    shapes have no gradient (TensorFlow registers none), so it reads nothing."""
    if op.type in op_types.GRADIENT_READS_NOTHING or op.type in op_types.SHAPE_ONLY_READERS:
        return (), ()
    if op.type in op_types.GRADIENT_READS_OUTPUTS:
        return (), tuple(op.outputs)
    if op.type in op_types.GRADIENT_READS_FIRST_INPUT:
        return tuple(op.inputs[:1]), ()
    if op.type in op_types.GRADIENT_READS_SECOND_INPUT:
        return tuple(op.inputs[1:2]), ()
    if op.type in op_types.GRADIENT_READS_SECOND_OUTPUT:
        return (), (op.outputs[1],)
    if op.type in op_types.GRADIENT_READS_TWO_INPUTS_AND_SAVED_OUTPUTS:
        return tuple(op.inputs[:2]), tuple(op.outputs[3:])
    if op.type in op_types.GRADIENT_READS_INPUTS_AND_OUTPUTS:
        return tuple(op.inputs), tuple(op.outputs)
    if op.type in op_types.GRADIENT_READS_DIVISOR and len(op.inputs) == 2:
        dividend, divisor = op.inputs
        return ((dividend, divisor) if needs_gradient(divisor) else (divisor,)), ()
    if op.type in op_types.GRADIENT_READS_OTHER_INPUT and len(op.inputs) == 2:
        first, second = op.inputs[0], op.inputs[1]
        return tuple(
            t for t, other in ((first, second), (second, first)) if needs_gradient(other)
        ), ()
    return tuple(op.inputs), ()


#: The v2 loop ops whose gradients read what their body's iterations kept.
WHILE_OP_TYPES = frozenset({"While", "StatelessWhile"})


@dataclasses.dataclass(frozen=True)
class LoopAccumulators:
    """What a v2 while loop keeps of each iteration for its gradient.

    ``per_step``: the body's tensors its ops' gradients read (:func:`gradient_reads`),
    but the loop's invariants (tensors the body passes through unchanged) and the
    outputs of ops that share another tensor's buffer (a variable's read: a list
    of it holds the variable's own buffer):
    TensorFlow pushes each onto a ``TensorList`` every iteration, and the loop's
    gradient pops them.  ``steps``: the trip count where it is static (the loop's
    ``maximum_iterations``, a counted condition's, or the length of a list the loop
    reads), else None.
    ``zeros_per_step``: the items the body writes into a list (``TensorListSetItem``, a
    recurrent layer's output sequence) whose shape is not static: each iteration of the
    loop's gradient writes a new zeros tensor of that item's size into the list's
    gradient (``zeros_like`` of a static shape is one constant), and they stay there
    until the gradient loop ends; only items whose buffer the loop also carries into a
    loop variable its gradient reads (elsewhere ``zeros_like`` writes into the popped
    buffer, which nothing else holds).
    """

    per_step: tuple
    steps: int | None
    zeros_per_step: tuple = ()


def loop_accumulators(op: tf.Operation) -> LoopAccumulators | None:
    """:class:`LoopAccumulators` of a v2 ``While`` op whose body this process built;
    None for any other op."""
    if op.type not in WHILE_OP_TYPES:
        return None
    body = _tf_internals.while_body_graph(op)
    if body is None:
        return None
    invariant = {a.ref() for a, b in zip(body.inputs, body.outputs) if a is b}
    read: dict = {}
    for body_op in body.get_operations():
        reads_in, reads_out = gradient_reads(body_op)
        for t in reads_in + reads_out:
            if (t.dtype not in (tf.resource, tf.variant) and t.ref() not in invariant
                    and not shares_input_buffer(t.op)):
                read.setdefault(t.ref(), t)
    # buffers the next iteration's gradient reads again, as a loop variable
    carried_read = {buffer_root(carried).ref()
                    for value, carried in zip(body.inputs, body.outputs) if value.ref() in read}
    for value, carried in zip(body.inputs, body.outputs):
        # a loop variable holds the buffer the iteration before made: a list of both
        # holds each buffer once
        if value.ref() in read and buffer_root(carried).ref() in read:
            del read[value.ref()]
    item = op_types.GRADIENT_ZEROS_LIKE_INPUT["TensorListSetItem"]
    # zeros_like of a popped item whose buffer nothing else holds writes into that
    # buffer (TensorFlow forwards it): only an item the loop also carries into a read
    # loop variable (an RNN's output, its next state) makes new zeros
    zeros = tuple(body_op.inputs[item] for body_op in body.get_operations()
                  if body_op.type == "TensorListSetItem" and len(body_op.inputs) > item
                  and not body_op.inputs[item].shape.is_fully_defined()
                  and buffer_root(body_op.inputs[item]).ref() in carried_read)
    return LoopAccumulators(tuple(sorted(read.values(), key=lambda t: t.name)),
                            _trip_count(op), zeros)


def buffer_root(tensor: tf.Tensor) -> tf.Tensor:
    """The tensor whose buffer ``tensor`` shares, through ops that forward their input's."""
    source = forwarded_input(tensor)
    while source is not None:
        tensor, source = source, forwarded_input(source)
    return tensor


def _trip_count(op: tf.Operation) -> int | None:
    """A ``While``'s static trip count: its ``maximum_iterations`` (its second input,
    as ``while_v2`` builds it), or else a counted condition's (:func:`_counted_trip_count`),
    or else the longest static length of a list it reads
    (the sequence a recurrent layer steps through, from ``TensorListFromTensor``;
    the lists it writes, from ``TensorListReserve``, may be shorter)."""
    if len(op.inputs) > 1:
        limit = tf.get_static_value(op.inputs[1])
        if limit is not None and int(limit) >= 0:
            return int(limit)
    counted = _counted_trip_count(op)
    if counted is not None:
        return counted
    lengths = []
    for t in op.inputs:
        maker = t.op
        if maker.type == "TensorListFromTensor" and maker.inputs[0].shape.rank:
            lengths.append(maker.inputs[0].shape[0])
        elif maker.type == "TensorListReserve":
            lengths.append(tf.get_static_value(maker.inputs[1]))
    lengths = [int(n) for n in lengths if n is not None and int(n) >= 0]
    return max(lengths) if lengths else None


#: Comparisons a counted loop's condition makes, and the sign of the step that ends it.
_LOOP_TESTS = {"Less": 1, "LessEqual": 1, "Greater": -1, "GreaterEqual": -1}
_FLIPPED_TESTS = {"Less": "Greater", "LessEqual": "GreaterEqual",
                  "Greater": "Less", "GreaterEqual": "LessEqual"}


def _through_identities(tensor: tf.Tensor) -> tf.Tensor:
    while tensor.op.type == "Identity":
        tensor = tensor.op.inputs[0]
    return tensor


def _counted_trip_count(op: tf.Operation) -> int | None:
    """The trip count of a counted loop: a condition ``i < limit`` (``<=``, ``>``,
    ``>=``) on a loop variable that starts at a static value and that the body steps
    by a static amount, with a static limit (``tf.while_loop(lambda i, h: i < 6, ...)``,
    autograph's ``for i in tf.range(n)`` with ``n`` static); None for any other loop."""
    cond, body = _tf_internals.while_cond_graph(op), _tf_internals.while_body_graph(op)
    if cond is None or body is None or len(cond.outputs) != 1:
        return None
    test = _through_identities(cond.outputs[0]).op
    if test.type not in _LOOP_TESTS or len(test.inputs) != 2:
        return None
    kind, (var, bound) = test.type, test.inputs
    positions = {t.ref(): i for i, t in enumerate(cond.inputs)}
    if var.ref() not in positions:
        kind, (bound, var) = _FLIPPED_TESTS[kind], test.inputs
    index = positions.get(var.ref())
    limit = _tf_internals.static_value_in(cond, bound)
    if index is None or limit is None or index >= min(len(op.inputs), len(body.outputs)):
        return None
    start = tf.get_static_value(op.inputs[index])
    stepped = _through_identities(body.outputs[index]).op
    if start is None or stepped.type not in ("Add", "AddV2", "Sub") or len(stepped.inputs) != 2:
        return None
    step = None
    for mine, other in (stepped.inputs, reversed(stepped.inputs)):
        if mine is body.inputs[index] and (stepped.type != "Sub" or mine is stepped.inputs[0]):
            step = _tf_internals.static_value_in(body, other)
            break
    if step is None or np.ndim(start) or np.ndim(limit) or np.ndim(step):
        return None
    step = -float(step) if stepped.type == "Sub" else float(step)
    if step == 0 or np.sign(step) != _LOOP_TESTS[kind]:
        return None
    span = (float(limit) - float(start)) / step
    count = math.ceil(span) if kind in ("Less", "Greater") else math.floor(span) + 1
    return max(0, int(count))


def gradient_reads_output_of(op: tf.Operation, consumer: tf.Operation,
                             needs_gradient: NeedsGradient = lambda tensor: True) -> bool:
    """Whether ``consumer``'s gradient reads an output of ``op``'s values;
    ``needs_gradient`` as for :func:`gradient_reads`.  A shape it reads at run time
    (one that is not static, with an unknown batch) does not count: a copy read only
    for its shape is not what holds memory.  Counted, it made a plan with an unknown
    batch keep more than the same graph's with the batch known (a residual conv net,
    batch 32: 13 checkpoints planned at 8.06 MB against 7 at 7.56), while both plans
    measured 7.56 MB; a Keras ViT's 'speed' was planned at 79 MB, measured 64."""
    read = {t.ref() for t in gradient_reads(consumer, needs_gradient)[0]}
    return any(t.op is op and t.ref() in read for t in consumer.inputs)


def needs_gradient_in(region: "ForwardRegion", xs_refs: Collection) -> NeedsGradient:
    """Whether a tensor's gradient is wanted: made in the region, or an x (by ``ref()``)."""
    return lambda t: t.op in region or t.ref() in xs_refs


def kept_read_by_gradients(region: "ForwardRegion", kept: Mapping, xs: Sequence[tf.Tensor]) -> frozenset:
    """Refs of the kept tensors that the gradient of a consumer reads (a product's or a
    convolution's input): they are held until that gradient whatever the plan, so the
    gradient of their producer, which comes next, reads them too instead of a copy
    (:func:`copies_that_run`).  A kept tensor no consumer's gradient reads (a ``Tanh``
    feeding a ``Tanh``) is still recomputed for its own gradient: held instead, it
    would stay live across the next segment's gradients, where its peak lies."""
    needs_gradient = needs_gradient_in(region, {x.ref() for x in xs})
    found = set()
    for ref, t in kept.items():
        if t.op not in region or not region.receives_gradient(t.op) or not gradient_reads(t.op)[1]:
            continue
        if any(c in region and region.receives_gradient(c)
               and gradient_reads_output_of(t.op, c, needs_gradient)
               for c in t.consumers()):
            found.add(ref)
    return frozenset(found)


def copies_that_run(ops: Sequence[tf.Operation], needs_gradient: NeedsGradient = lambda tensor: True,
                    kept: Collection = frozenset(),
                    receives_gradient: Callable[[tf.Operation], bool] = lambda op: True) -> set:
    """The ops of a recomputed segment whose copies actually run.

    A copy runs when a gradient in the segment reads its outputs, or when it
    feeds a copy that runs; the others (e.g. a convolution that only feeds a
    residual add, or attention scores only scaled by a constant) are pruned
    by grappler, since nothing reads them.  ``needs_gradient(tensor)``: whether
    an input's gradient is wanted (a product's gradient for a constant factor
    is computed, but nothing fetches it).  ``kept``: refs of kept tensors whose
    producer's gradient reads the kept tensor, not a copy
    (:func:`kept_read_by_gradients`); an op whose own gradient reads only such
    outputs of it (a kept ``Relu`` output feeding a convolution) is not copied for
    that gradient (:func:`.rewrite.read_kept_outputs`).  ``receives_gradient(op)``:
    whether the op's gradient is built at all (:meth:`ForwardRegion.receives_gradient`);
    one that is not reads nothing.
    """
    inside = set(ops)
    # what a custom gradient's closure reads, made in the segment: its gradient reads
    # the copy (:func:`.rewrite.closures_read_copies`)
    running: set = {t.op for op in ops for t in custom_gradient_closure_reads(op)
                    if t.op in inside}
    for op in sorted(ops, key=op_order, reverse=True):
        if op in running or (receives_gradient(op) and any(
                t.ref() not in kept for t in gradient_reads(op)[1])) or any(
            c in running or (receives_gradient(c) and gradient_reads_output_of(op, c, needs_gradient))
            for t in op.outputs for c in t.consumers() if c in inside
        ):
            running.add(op)
    return running


#: Stateless ops grappler's constant folding leaves alone (a fed default; a fill that
#: may be larger than the constants it makes).
_NOT_FOLDED = frozenset({"PlaceholderWithDefault", "Fill"})


def _folds_to_constant(op: tf.Operation, folded: dict, made_after: int) -> bool:
    """Whether grappler's constant folding turns ``op`` into a constant: a ``Const``, a
    shape-only read (``Shape``, ``Size``, ...) of statically shaped tensors, or, for an
    op made after ``made_after``, a stateless op of such constants only.  Older ops
    are judged by a short walk (:func:`_folds_near_constants`, :data:`OLDER_FOLD_DEPTH`
    producers); ``folded`` remembers the answers.  The walk keeps its own stack (a
    graph's ancestry may be deeper than
    Python's recursion limit), and a cycle (a v1 loop's ``NextIteration``) folds
    nothing."""
    stack = [op]
    while stack:
        current = stack[-1]
        if folded.get(current) is not None:
            stack.pop()
            continue
        if current not in folded:
            found = _folds_by_type(current, made_after)
            if found is not None:
                folded[current] = found
                stack.pop()
                continue
            folded[current] = None  # on the stack: a cycle back to it folds nothing
        found, unseen = True, None
        for t in current.inputs:
            if t.op not in folded:
                unseen = t.op
                break
            if folded[t.op] is not True:
                found = False
                break
        if unseen is not None:
            stack.append(unseen)
            continue
        folded[current] = found
        stack.pop()
    return folded[op]


def _folds_by_type(op: tf.Operation, made_after: int) -> bool | None:
    """:func:`_folds_to_constant` of ``op`` where its type alone decides; ``None`` where
    it folds when all its inputs do."""
    if op.type == "Const":
        return True
    if op.type == "BroadcastGradientArgs":  # reads shapes as values
        return None
    if op.type in op_types.SHAPE_ONLY_READERS:
        return all(t.shape.is_fully_defined() for t in op.inputs)
    if not _may_fold(op):
        return False
    if op_order(op) <= made_after:
        return _folds_near_constants(op, OLDER_FOLD_DEPTH)
    return None


#: How many producers back :func:`_folds_to_constant` looks from an op older than the
#: step (a forward op): a ``tf.cast`` of a constant scale is one.
OLDER_FOLD_DEPTH = 3


def _folds_near_constants(op: tf.Operation, depth: int) -> bool:
    """Whether a stateless op folds, its inputs ``Const`` s or such ops within ``depth``
    producers.  Judged wrongly unfoldable, a gradient op of such constants alone (the
    ``Conj`` of a complex ``tf.cast(0.9)`` scale) was made to wait for its step's
    recomputation; grappler folded it anyway, kept the wait, and merged it with the
    same constant of an earlier step, whose gradients the wait comes after: a cycle."""
    if not all(t.shape.is_fully_defined() and tensor_bytes(t) <= GRAPPLER_MAX_CONSTANT_BYTES
               for t in op.outputs):
        return False  # grappler leaves it as it is
    if op.type == "Const":
        return True
    if depth <= 0 or not _may_fold(op):
        return False
    return all(_folds_near_constants(t.op, depth - 1) for t in op.inputs)


def _may_fold(op: tf.Operation) -> bool:
    """Whether constant folding may fold ``op`` once its inputs are constants: a
    stateless op with inputs and no control inputs, not one it leaves alone."""
    return (op.type not in _NOT_FOLDED and bool(op.inputs) and not op.control_inputs
            and not _is_stateful(op))


#: The largest tensor grappler's constant folding makes (its ``kMaxConstantSize``).
GRAPPLER_MAX_CONSTANT_BYTES = 10 * 2**20


def _is_stateful(op: tf.Operation) -> bool:
    try:
        return op.op_def.is_stateful
    except (KeyError, ValueError):  # a function called by name: no registered OpDef
        return True


def early_gradient_ops(gradients: Sequence[tf.Tensor], copies: Iterable[tf.Operation],
                       made_after: int) -> tuple:
    """``(entries, sinks, early)``: where a recomputed step's gradients may run before
    its recomputation, the copies that end it, and every op that may run early.

    The memory model runs a step's copies first and then its gradient ops
    (:mod:`.simulate`).  A gradient op that reads no recomputed value (the slice
    of a concat's gradient for the input that was kept, a convolution of that
    slice with a weight) is free to run as soon as the incoming gradient is
    there, before the copies; its buffer is then held across the recomputation,
    which the model does not count (a U-Net's plan measured 4-8 MB over its
    prediction, varying with the executor's order).  A copy's shape is no read:
    grappler folds it into a constant, as it does constant copies.

    ``gradients``: the step's input gradients (tensors); the ops made for them
    are the ancestors with a creation id above ``made_after``.  ``entries``:
    those that read no recomputed value, directly or through another of them,
    and read a value from outside (the incoming gradient), none made by another
    entry's kind; ``sinks``: the copies that run (read by a gradient op, or
    feeding one that is) and feed no other copy that runs.  Making the
    entries wait for the sinks gives the model's order.  Empty lists where no op
    is free or nothing recomputed is read.  Linear in the ops.
    """
    copies = set(copies)
    folded: dict = {}

    def folds(op) -> bool:
        return _folds_to_constant(op, folded, made_after)

    made: dict = {}  # op made for the step -> whether it reads a recomputed value
    stack = [t.op for t in gradients if op_order(t.op) > made_after]
    order = []
    seen: set = set()
    while stack:  # the ops made for the step, found from the gradients back
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        order.append(op)
        for above in [t.op for t in op.inputs] + list(op.control_inputs):
            if op_order(above) > made_after and above not in seen:
                stack.append(above)
    order.sort(key=op_order)  # inputs before their readers

    def recomputed(op) -> bool:
        return (op in copies and not folds(op)) or made.get(op, False)

    read_copies = set()
    for op in order:
        if folds(op):
            made[op] = False
            continue
        above = [t.op for t in op.inputs] + list(op.control_inputs)
        made[op] = any(recomputed(a) for a in above)
        read_copies.update(a for a in above if a in copies and not folds(a))
    early = {op for op in order if not made[op] and not folds(op)}
    entries = [
        op for op in order if op in early
        and not any(a in early for a in [t.op for t in op.inputs] + list(op.control_inputs))
        and any(not folds(t.op) for t in op.inputs)
    ]
    if not entries or not read_copies:
        return [], [], []
    running = set()
    stack = list(read_copies)
    while stack:  # the copies that run: those read, and the copies they read
        op = stack.pop()
        if op in running:
            continue
        running.add(op)
        stack.extend(t.op for t in op.inputs
                     if t.op in copies and not folds(t.op))
    sinks = [op for op in sorted(running, key=op_order)
             if not any(c in running for t in op.outputs for c in t.consumers())]
    return entries, sinks, sorted(early, key=op_order)


def is_differentiable_in_place(op: tf.Operation) -> bool:
    """Whether ``op``'s registered gradient can be called on its own, outside ``tf.gradients``.

    Control flow and function calls need ``tf.gradients``' own machinery.
    """
    return (
        op.type not in op_types.CONTROL_FLOW
        and v1_control_flow_context(op) is None
        and not _tf_internals.is_function_call(op)
    )


def carries_gradient(tensor: tf.Tensor) -> bool:
    """Whether ``tf.gradients`` lets a gradient flow through ``tensor``: TensorFlow's own
    rule (``backprop_util.IsTrainable``): float and complex tensors, resource handles,
    and variants (the ``TensorList`` s of loops, ``TensorArray`` s, optionals) unless
    they hold integers."""
    return _tf_internals.is_trainable(tensor)



def blocks_gradients(op: tf.Operation) -> bool:
    """Whether ``op``'s registered gradient is None (``tf.no_gradient``: StopGradient,
    Shape, ...): no gradient flows from its outputs to its inputs.  An op with no
    gradient registered at all does not count (``tf.gradients`` raises on it)."""
    try:
        return _tf_internals.gradient_function(op) is None
    except LookupError:
        return False


def reached_by_tf_gradients(xs: Sequence[tf.Tensor], region: ForwardRegion | None = None) -> set:
    """The ops ``tf.gradients``' walk reaches from the ops of ``xs``: it follows the
    tensors that carry gradients (:func:`carries_gradient`) to their consumers (those
    in ``region`` only, when given)."""
    reached: set = set()
    stack = [x.op for x in xs]
    while stack:
        op = stack.pop()
        if op in reached:
            continue
        reached.add(op)
        for t in op.outputs:
            if carries_gradient(t):
                stack.extend(c for c in t.consumers() if region is None or c in region)
    return reached


def is_float_or_complex(tensor: tf.Tensor) -> bool:
    """Whether ``tensor`` holds float or complex values: its gradient is then a tensor of
    its own size (that of a resource or variant handle is the size of what it refers to)."""
    dtype = tensor.dtype.base_dtype
    return dtype.is_floating or dtype.is_complex


@dataclasses.dataclass(frozen=True)
class ForwardRegion:
    """The ops on a path from ``xs`` to ``ys`` (the ops ``tf.gradients`` differentiates).

    ``ops`` is a set of operations; ``order`` lists them in topological order.
    """

    ops: frozenset
    order: tuple
    #: The ops whose gradient ``tf.gradients`` builds: those a gradient reaches from
    #: ``ys`` (see :func:`forward_region`); None: every op.
    differentiated: frozenset | None = None

    def receives_gradient(self, op: tf.Operation) -> bool:
        """Whether a gradient reaches ``op`` from ``ys``, so that its gradient is built and
        reads what it reads.  Not the ops only behind a ``StopGradient`` or an integer (a
        ``tf.stop_gradient`` branch, the distances an ``argmin`` picks from), nor those
        inside a ``tf.custom_gradient`` function."""
        return self.differentiated is None or op in self.differentiated

    def __contains__(self, op: tf.Operation) -> bool:
        return op in self.ops

    def produces(self, tensor: tf.Tensor) -> bool:
        return tensor.op in self.ops

    def is_recomputable(self, op: tf.Operation) -> bool:
        """:func:`is_recomputable` for an op of the region, remembered."""
        return op not in self._not_recomputable

    @functools.cached_property
    def _not_recomputable(self) -> frozenset:
        return frozenset(op for op in self.order if not is_recomputable(op))

    @functools.cached_property
    def fixed_boundary_ops(self) -> frozenset:
        """Ops differentiated in place whatever the checkpoints: the ones that are not
        recomputable, and the producers of their inputs."""
        ops = set(self._not_recomputable)
        for op in self._not_recomputable:
            ops.update(t.op for t in op.inputs if t.op in self.ops)
        return frozenset(ops)

    @functools.cached_property
    def computed_outside(self) -> tuple:
        """``(tensor, buffer)`` for each tensor the region's ops read from outside it that
        the step computes itself (a dropout's mask from a seed, a rescaled input):
        ``buffer`` is the tensor whose buffer it holds (itself, or what an identity or
        reshape of it forwards).  What is fed, constants (also those grappler folds),
        variables' values and a dataset's elements are left out: the step allocates
        none of them."""
        folded: dict = {}
        found = []
        for t in read_from_outside(self):
            buffer = buffer_root(t)
            if (buffer.dtype in (tf.resource, tf.variant)
                    or buffer.op.type in op_types.NOT_ALLOCATED_IN_STEP
                    or _folds_to_constant(buffer.op, folded, made_after=-1)):
                continue
            found.append((t, buffer))
        return tuple(found)

    def consumed_outputs(self, op: tf.Operation) -> tuple:
        """Outputs of ``op`` consumed by ops of the region."""
        return self._consumed[op]

    @functools.cached_property
    def _consumed(self) -> dict:
        return {
            op: tuple(t for t in op.outputs if any(c in self.ops for c in t.consumers()))
            for op in self.order
        }

    def inputs_with_refs(self, op: tf.Operation) -> tuple:
        """``(tensor, tensor.ref())`` for each input of an op of the region."""
        return self._inputs[op]

    @functools.cached_property
    def _inputs(self) -> dict:
        return {op: tuple((t, t.ref()) for t in op.inputs) for op in self.order}


def forward_region(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor],
                   stops: Sequence[tf.Tensor] = ()) -> ForwardRegion:
    """Ops reachable from ``xs`` through data edges that also reach some of ``ys``
    other than through one of ``stops`` (``stop_gradients``: no gradient passes them).
    A y that cannot carry a gradient (an integer: an argmax) reaches nothing."""
    stopped = {t.ref() for t in stops}
    reached_from_xs: set = set()
    stack = [consumer for x in xs for consumer in x.consumers()]
    while stack:
        op = stack.pop()
        if op in reached_from_xs:
            continue
        reached_from_xs.add(op)
        for output in op.outputs:
            stack.extend(output.consumers())
    region: set = set()
    starts = [y.op for y in ys if y.op in reached_from_xs and y.ref() not in stopped
              and carries_gradient(y)]
    stack = list(starts)
    while stack:
        op = stack.pop()
        if op in region:
            continue
        region.add(op)
        stack.extend(t.op for t in op.inputs
                     if t.op in reached_from_xs and t.ref() not in stopped)
    return ForwardRegion(frozenset(region), tuple(sorted(region, key=op_order)),
                         _differentiated(starts, region, stopped))


def _differentiated(starts: list, region: set, stopped: set) -> frozenset:
    """The ops of ``region`` a gradient reaches from ``starts`` (the ops of ys) as
    ``tf.gradients`` passes it: not through an op whose registered gradient is None
    (:func:`blocks_gradients`), nor along a tensor that carries none (an integer, a
    ``stop_gradients`` tensor), and through a ``tf.custom_gradient`` op only to its
    arguments (its gradient function stands for the ops inside)."""
    reached: set = set()
    stack = list(starts)
    with _tf_internals.gradient_types_remembered():  # each op's override read once
        while stack:
            op = stack.pop()
            if op in reached:
                continue
            reached.add(op)
            if blocks_gradients(op):
                continue
            arguments = custom_gradient_arguments(op)
            stack.extend(t.op for t in (op.inputs if arguments is None else arguments)
                         if t.op in region and t.ref() not in stopped and carries_gradient(t))
    return frozenset(reached)


def gradient_carriers(region: ForwardRegion, xs: Sequence[tf.Tensor],
                      blocks: Callable[[tf.Operation], bool],
                      trainable: Callable[[tf.Tensor], bool]) -> frozenset:
    """Refs of the tensors (``xs`` and region outputs) whose gradient can reach some x.

    A gradient flows back through an op unless ``blocks(op)`` (its registered
    gradient is None, as for ``StopGradient``), and only through outputs for
    which ``trainable(tensor)``.  A kept tensor outside this set (e.g. the
    ``StopGradient`` of the mean in ``tf.nn.moments``) still cuts the
    recomputation, but no gradient is computed for it: one would only be
    thrown away, after the ordering of the backward pass had made it run.
    """
    carriers = {x.ref() for x in xs}
    stack = list(xs)
    reached: set = set()
    while stack:  # along data edges, in any order (v1 loops have back edges)
        for op in stack.pop().consumers():
            if op in reached or op not in region or blocks(op):
                continue
            reached.add(op)
            for t in op.outputs:
                if trainable(t) and t.ref() not in carriers:
                    carriers.add(t.ref())
                    stack.append(t)
    return frozenset(carriers)


def has_unknown_size(tensor: tf.Tensor) -> bool:
    """Whether a tensor's size depends on dimensions unknown before it runs.

    Resources and variants have no size here; an unknown rank counts only
    on an op's first output (side outputs such as a batch norm's reserve
    space have unknown rank even when every dimension of the model is known).
    """
    if tensor.dtype in (tf.resource, tf.variant):
        return False
    if tensor.shape.rank is None:
        return tensor.value_index == 0
    return not tensor.shape.is_fully_defined()


def unknown_size_tensors(region: ForwardRegion) -> list:
    """The region's tensors with an unknown size, as plans count them: the inputs its
    ops read from outside it (a placeholder), then the outputs of its ops."""
    outputs = [t for op in region.order for t in op.outputs]
    return [t for t in [*read_from_outside(region), *outputs] if has_unknown_size(t)]


def has_unknown_dims(region: ForwardRegion) -> str:
    """A short description of the region's tensors with unknown dimensions
    (e.g. ``"12 tensors, e.g. dense/MatMul:0 (None, 64)"``), or ``""``."""
    unknown = unknown_size_tensors(region)
    if not unknown:
        return ""
    count = "1 tensor" if len(unknown) == 1 else f"{len(unknown)} tensors"
    return f"{count}, e.g. {unknown[0].name} {unknown[0].shape}"


def read_from_outside(region: ForwardRegion) -> list:
    """The tensors the region's ops read from outside it (what is fed: placeholders,
    a dataset's elements, variables), each once."""
    found = {t.ref(): t for op in region.order for t in op.inputs if t.op not in region.ops}
    return list(found.values())


def fed_tensors(region: ForwardRegion) -> list:
    """What the region's inputs are computed from: walking back from the tensors it
    reads from outside it, the outputs of ops that read no tensor of rank one or more
    (placeholders, a dataset iterator's elements, variables' values, constants)."""
    sources, seen = {}, set()
    pending = [t.op for t in read_from_outside(region)]
    while pending:
        op = pending.pop()
        if op in seen:
            continue
        seen.add(op)
        inputs = [t for t in op.inputs if t.shape.rank != 0]
        if not inputs:
            sources.update((t.ref(), t) for t in op.outputs)
        pending.extend(t.op for t in inputs)
    return list(sources.values())


def batch_is_unknown(region: ForwardRegion) -> bool:
    """Whether a tensor fed (:func:`fed_tensors`) has an unknown first dimension (an
    unknown batch), as opposed to unknown sizes made in the graph only (a loop's
    length) or fed in other dimensions (a sequence length)."""
    return any(t.shape.rank and t.shape.as_list()[0] is None for t in fed_tensors(region))


def first_unknown(region: ForwardRegion, fed_only: bool = False) -> "tf.Tensor | None":
    """The first of the region's tensors with an unknown size (``fed_only``: of the
    tensors fed, :func:`fed_tensors`), or None."""
    tensors = fed_tensors(region) if fed_only else unknown_size_tensors(region)
    return next((t for t in tensors if has_unknown_size(t)), None)


def unknown_beyond_batch(region: ForwardRegion) -> "tf.Tensor | None":
    """A tensor with an unknown dimension besides the batch, or None: one fed with an
    unknown dimension after its first (a sequence length), else one made in the region
    with two or more unknown dimensions (a transpose may move the batch, so one unknown
    dimension elsewhere than first may be the batch itself).  The planner counts every
    unknown dimension as one size."""
    for t in fed_tensors(region):
        if t.shape.rank and any(d is None for d in t.shape.as_list()[1:]):
            return t
    for op in region.order:
        for t in op.outputs:
            if t.shape.rank and sum(d is None for d in t.shape.as_list()) >= 2:
                return t
    return None


def boundary_tensors(
    region: ForwardRegion,
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    checkpoints: Iterable[tf.Tensor],
) -> dict:
    """The tensors kept from the forward pass, keyed by ``ref()``.

    These are ``xs``, ``ys``, the checkpoints, and the tensors around every op
    that is not recomputable (its region outputs, and its inputs produced in
    the region), since such an op is differentiated in place.  A checkpoint,
    x or y keeps every region output of its op, so that no op is ever both
    kept and recomputed.
    """
    kept: dict = {}
    for t in list(xs) + list(ys):
        kept.setdefault(t.ref(), t)
    boundary_ops = {t.op for t in list(checkpoints) + list(xs) + list(ys) if t.op in region}
    boundary_ops |= region.fixed_boundary_ops
    for op in sorted(boundary_ops, key=op_order):
        for t in region.consumed_outputs(op):
            kept.setdefault(t.ref(), t)
    return kept


@dataclasses.dataclass(frozen=True)
class Segment:
    """What the backward pass recomputes (or differentiates in place) for one group.

    ``targets`` are kept tensors produced by one op; ``ops`` (topological
    order) are the ops between them and the kept tensors they depend on;
    ``inputs`` are those kept tensors.  ``recompute`` is False when the
    segment is a single op whose gradient reads none of its outputs: it is
    then differentiated in place, since its region inputs are kept anyway and
    a copy would only cost time.  (An op whose gradient reads its outputs is
    recomputed, so that its kept output can be freed early; where a consumer's
    gradient holds that output anyway, :func:`kept_read_by_gradients`, the copy is
    built but does not run.)
    """

    targets: tuple
    ops: tuple
    inputs: tuple
    recompute: bool


def segment_for(
    targets: Sequence[tf.Tensor], region: ForwardRegion, kept: dict
) -> Segment:
    """Walk back from ``targets`` to the kept tensors; linear in the segment's size."""
    root = targets[0].op
    seen = {root}
    stack = [root]
    inputs: dict = {}
    while stack:
        op = stack.pop()
        for t, ref in region.inputs_with_refs(op):
            if ref in kept:
                inputs.setdefault(ref, t)
            elif t.op in region and t.op not in seen:
                seen.add(t.op)
                stack.append(t.op)
    ops = tuple(sorted(seen, key=op_order))
    return Segment(
        targets=tuple(targets),
        ops=ops,
        inputs=tuple(sorted(inputs.values(), key=tensor_order)),
        recompute=region.is_recomputable(root)
        and (len(ops) > 1 or bool(gradient_reads(root)[1])),
    )


class DisjointSets:
    """Union-find over hashable items (path halving); an item is in a set of its own
    until :meth:`union` joins it with another's."""

    def __init__(self):
        self._parent: dict = {}

    def find(self, item: Hashable) -> Hashable:
        """The representative of ``item``'s set."""
        parent = self._parent
        while parent.setdefault(item, item) is not item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    def union(self, a: Hashable, b: Hashable) -> None:
        """Join the sets of ``a`` and ``b``."""
        self._parent[self.find(a)] = self.find(b)


def backward_groups(
    region: ForwardRegion, kept: dict, producers: Iterable[tf.Operation],
    isolated: frozenset = frozenset(), results: frozenset = frozenset(),
) -> list:
    """``[(members, segment)]``: the groups the backward pass differentiates, in its order.

    Each producer of kept tensors is a group of its own, with the segment
    :func:`segment_for` walks back from it, unless its recomputed segment
    shares ops with another's (q, k and v kept, the layer norm and the
    projection before them not): such groups are merged into one segment,
    recomputed and differentiated once with all their targets, instead of once
    per target.  A group is handled after every group whose segment reads its
    tensors (those complete its gradients); a merge that would make that
    impossible (a cycle: a member's gradient waiting for a group that reads
    another member) is split again (all merges are, if the groups' reads form a
    cycle without one, as around a v1 loop).  Within a merged group, a member's kept
    tensor that another member's segment reads is read as its copy (the group's
    gradients flow through it), unless its ref is in ``results`` (an x, whose own
    gradient is wanted): then it stays an input, and the merge is split.  ``isolated`` ops (v1 control-flow
    constructs, stop_gradients) are never merged; their segment is None (the
    caller makes it).  Among the groups that are ready, the latest comes
    first: without merges this is reverse topological order, as before.
    Linear in the segments' sizes (times a log for the ordering).
    """
    ordered = sorted(set(producers), key=op_order)
    position = {op: i for i, op in enumerate(ordered)}
    segments: dict = {}
    sharing = DisjointSets()
    owner: dict = {}
    for op in ordered:
        if op in isolated:
            continue
        targets = [t for t in op.outputs if t.ref() in kept] or list(op.outputs)
        segment = segment_for(targets, region, kept)
        segments[op] = segment
        if not segment.recompute:
            continue
        for inner in segment.ops:
            if inner is op:
                continue
            other = owner.setdefault(inner, op)
            if other is not op:
                sharing.union(op, other)
    members: dict = {}
    for op in ordered:
        members.setdefault(sharing.find(op), []).append(op)
    groups = [tuple(g) for g in members.values()]
    while True:
        if all(len(g) == 1 for g in groups):
            order = sorted(groups, key=lambda g: position[g[0]], reverse=True)
            break
        order, stuck = _reverse_dependency_order(groups, segments, position, results)
        if not stuck:
            break
        # split the merged groups on a cycle; a cycle without one (the back edge of
        # a v1 loop) leaves no order to trust but the plain one: no merges at all
        split = [g for g in stuck if len(g) > 1] or [g for g in groups if len(g) > 1]
        groups = [g for g in groups if g not in split] + [(m,) for g in split for m in g]
    result = []
    for group in order:
        if len(group) == 1:
            result.append((group, segments.get(group[0])))
            continue
        ops = {o for m in group for o in segments[m].ops}
        # a member's kept tensor that another member's segment reads is read as its copy
        inputs = {t.ref(): t for m in group for t in segments[m].inputs
                  if t.op not in ops or t.ref() in results}
        result.append((group, Segment(
            targets=tuple(t for m in group for t in segments[m].targets),
            ops=tuple(sorted(ops, key=op_order)),
            inputs=tuple(sorted(inputs.values(), key=tensor_order)),
            recompute=True,
        )))
    return result


def _reverse_dependency_order(groups: list, segments: dict, position: dict,
                              results: frozenset = frozenset()) -> tuple:
    """``(order, stuck)``: the groups, each after every group whose segment reads one of
    its tensors, the latest ready one first; ``stuck``: the groups on or behind a cycle."""
    group_of = {op: g for g in groups for op in g}
    waiting = {g: 0 for g in groups}
    feeds: dict = {g: set() for g in groups}  # reader -> groups whose tensors it reads
    for g in groups:
        for m in g:
            segment = segments.get(m)
            for t in segment.inputs if segment is not None else ():
                source = group_of.get(t.op)
                if source is None or source in feeds[g] or (
                        source is g and t.ref() not in results):
                    continue  # a member's tensor another member reads: read as its copy
                feeds[g].add(source)
                waiting[source] += 1
    ready = [(-max(position[m] for m in g), g) for g in groups if not waiting[g]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, g = heapq.heappop(ready)
        order.append(g)
        for source in feeds[g]:
            waiting[source] -= 1
            if not waiting[source]:
                heapq.heappush(ready, (-max(position[m] for m in source), source))
    done = set(order)
    return order, [g for g in groups if g not in done]


def in_function_body_of(tensor: tf.Tensor, graph: tf.Graph) -> bool:
    """Whether ``tensor`` lives in a function graph nested in ``graph``.

    E.g. a tensor of the body of a v2 ``tf.while_loop`` or a ``tf.cond``
    branch built in ``graph``: those are ``FuncGraph`` s whose ``outer_graph``
    chain leads to ``graph``.
    """
    inner = getattr(tensor, "graph", None)
    if inner is None or inner is graph:
        return False
    inner = getattr(inner, "outer_graph", None)
    while inner is not None:
        if inner is graph:
            return True
        inner = getattr(inner, "outer_graph", None)
    return False


def _root_context(op: tf.Operation):
    return v1_control_flow_context(op)


def control_flow_constructs(region: ForwardRegion) -> dict:
    """The v1 ``tf.while_loop``/``tf.cond`` constructs of the region: ``{op: construct}``.

    A construct is the tuple (topological order) of the region's ops of one
    outermost v1 loop or conditional: the ops in its control-flow contexts
    (nested ones included), and the context-free ``Merge``s that join a
    cond's branches and ``Switch``es that feed them.  Such ops are
    differentiated together, by one ``tf.gradients`` call from the
    construct's outputs to its inputs, since TensorFlow's v1 gradient of a
    loop or cond needs them all.  Its last op (an ``Exit`` or ``Merge``) was
    created after all the others, so ops that consume its outputs come later
    in the topological order.  Ops outside v1 control flow are absent.
    """
    joined_with = DisjointSets()
    union = joined_with.union
    members = []
    for op in region.order:
        root = _root_context(op)
        if root is not None:
            union(op, root)
            members.append(op)
        elif op.type in op_types.V1_MERGES:
            # A cond's Merge joins its branches (its inputs' contexts).
            joined = [_root_context(t.op) for t in op.inputs]
            for context in joined:
                if context is not None:
                    union(op, context)
            if any(c is not None for c in joined):
                members.append(op)
        elif op.type in op_types.V1_SWITCHES:
            # A cond's predicate Switch feeds its branches (its consumers' contexts).
            joined = [_root_context(c) for t in op.outputs for c in t.consumers()]
            for context in joined:
                if context is not None:
                    union(op, context)
            if any(c is not None for c in joined):
                members.append(op)
    groups: dict = {}
    for op in members:
        groups.setdefault(joined_with.find(op), []).append(op)
    constructs: dict = {}
    for ops in groups.values():
        ops = tuple(sorted(ops, key=op_order))
        for op in ops:
            constructs[op] = ops
    return constructs


def construct_segment(
    construct: Sequence[tf.Operation], targets: Sequence[tf.Tensor], kept: dict
) -> Segment:
    """A v1 control-flow construct as one segment, differentiated in place.

    ``inputs`` are the kept tensors its ops consume from outside it.
    """
    members = set(construct)
    inputs: dict = {}
    for op in construct:
        for t in op.inputs:
            if t.op not in members and t.ref() in kept:
                inputs.setdefault(t.ref(), t)
    return Segment(
        targets=tuple(targets),
        ops=tuple(construct),
        inputs=tuple(sorted(inputs.values(), key=tensor_order)),
        recompute=False,
    )


def tensor_bytes(tensor: tf.Tensor, unknown_dim: int = 1, dims: Sequence | None = None) -> int:
    """Static size of a tensor in bytes; unknown dims count as ``unknown_dim``, or
    ``dims`` (its dimensions, unknown ones estimated) gives them all."""
    shape = tensor.shape
    if shape.rank is None and dims is None:
        return tensor.dtype.size if tensor.dtype != tf.resource else 0
    count = 1
    for dim in shape.as_list() if dims is None else dims:
        count *= unknown_dim if dim is None else dim
    try:
        return count * tensor.dtype.size
    except TypeError:  # string/variant/resource
        return 0

"""The only module that creates or changes TensorFlow graph structure.

Layer: mutation (the only code that changes TensorFlow graphs); imports: graph, ops,
_tensorflow.

It copies ops, adds control inputs to ops it created, and builds the small
ops the backward pass needs (default ``grad_ys``, gradient sums).  It reaches
TensorFlow's private graph API through :mod:`._tensorflow` only, and it is the
only caller of that module's graph-changing functions.  It never decides what
to copy: callers pass the ops.

Ops that existed before a call are never changed: copies are new ops, and
control inputs are only ever added to new ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, Collection, Iterable, Iterator, Optional, Sequence, Union

from . import _tensorflow as _tf_internals
from . import graph as graph_lib
from . import ops as op_types
from ._tensorflow import tf

#: One gradient as ``tf.gradients`` gives it: dense, ``IndexedSlices``, or None.
Gradient = Optional[Union[tf.Tensor, tf.IndexedSlices]]
#: A registered gradient function: ``(op, *output_gradients) -> input gradient(s)``.
GradientFunction = Callable[..., Any]


@contextlib.contextmanager
def clean_scope(graph: tf.Graph, name_scope: str) -> Iterator[None]:
    """Enter ``graph`` with no inherited control dependencies, device or colocation.

    Copies must not pick up whatever ``tf.control_dependencies`` or
    ``tf.device`` block the caller happens to be in; they take the device and
    colocation of the op they copy instead.  An XLA context (v1
    ``xla.compile``) is kept.
    """
    context = _tf_internals.graph_control_flow_context(graph)
    with graph.as_default(), _tf_internals.control_dependencies(None), graph.colocate_with(
        None, ignore_existing=True
    ), _tf_internals.device_scope(None), _tf_internals.name_scope(name_scope):
        if context is not None and context.IsXLAContext():
            # control_dependencies(None) also leaves the control flow context;
            # an XLA one (v1 xla.compile) must stay, or the new ops fall
            # outside the computation that reads them.
            _tf_internals.set_graph_control_flow_context(graph, context)
        yield


def copy_ops(
    ops: Sequence[tf.Operation],
    replacements: dict,
    control_inputs: Sequence[tf.Operation],
    name_scope: str,
) -> dict:
    """Copy ``ops`` (in topological order) and return ``{original ref: copy}`` for their outputs.

    An input of a copied op is taken from, in order: the copy of its producer,
    ``replacements`` (keyed by ``tensor.ref()``), or the original tensor.
    Control inputs between copied ops are mapped to the copies, others are
    kept; every copy that reads neither another copy nor a replacement also
    gets ``control_inputs`` (the others wait for them through their data), and so
    does a narrowing cast-like copy of a replacement (see :func:`proxies`).  Device,
    colocation, attrs and static shapes of the originals are kept.
    """
    if not ops:
        return {}
    graph = ops[0].graph
    copies: dict = dict(replacements)
    copied_ops: dict = {}
    with clean_scope(graph, name_scope):
        for op in ops:
            inputs = [copies.get(t.ref(), t) for t in op.inputs]
            new_op = _tf_internals.create_op(
                graph,
                op.type,
                inputs,
                dtypes=[t.dtype for t in op.outputs],
                input_types=[t.dtype for t in op.inputs],
                name=op.name,
                attrs=_copied_attrs(op),
                op_def=op.op_def,
                compute_device=False,
            )
            _tf_internals.set_op_device(new_op, op.device)
            deps = [copied_ops.get(c, c) for c in op.control_inputs]
            if not any(t.op in copied_ops or t.ref() in replacements for t in op.inputs) or (
                    _cast_widening(op) < 0 and op.inputs[0].ref() in replacements):
                # Only copies that read neither another copy nor a replacement
                # wait for control_inputs; the rest wait through their data,
                # and grappler may still optimize them (see proxies()). A narrowing
                # cast of a replacement waits too: grappler moves it before the
                # replacement's identity, where it would run in the forward pass.
                deps.extend(control_inputs)
            if deps:
                _tf_internals.add_control_inputs(new_op, _unique_ops(deps))
            for old, new in zip(op.outputs, new_op.outputs):
                new.set_shape(old.shape)
                copies[old.ref()] = new
            copied_ops[op] = new_op
            _note_copy(new_op, op)
            originals = _originals.setdefault(graph, {})
            originals[new_op] = originals.get(op, op)
    return {
        t.ref(): copies[t.ref()] for op in ops for t in op.outputs
    }


@dataclasses.dataclass
class _Gate:
    """What one copy's gradient function built: its gradients' ops (``producers``), the
    newest of their op ids, the newest op id of its step's ``tf.gradients`` call, and
    whether they should wait for each other (``mixed``: some read a recomputed tensor,
    some do not)."""

    producers: list
    newest_id: int
    step_last_id: int
    mixed: bool

    def wait(self, waited_for) -> None:
        """Each consumer of the producers made in the same step, after them, waits for
        ``waited_for(producer)``."""
        for producer in self.producers:
            for t in producer.outputs:
                for consumer in t.consumers():
                    if self.newest_id < graph_lib.op_order(consumer) <= self.step_last_id:
                        add_control_inputs([consumer], waited_for(producer))

    def wait_for_each_other(self) -> None:
        self.wait(lambda producer: [p for p in self.producers if p is not producer])


class GradientGates:
    """The gates of one backward pass: which copies' input gradients wait, and for what.

    While a step's gradients are built (:meth:`recording`), the gradient
    function of every copy is noted.  Where one copy's gradients are *mixed*
    (two or more, of which some read a recomputed tensor, an output of one of
    the step's copies, and some do not), every op ``tf.gradients`` then
    builds on one of them waits (a control input) for the ops of the others:
    without it the executor runs ahead on the gradient that is ready first
    (the slices below a convolution's input gradient) while another still
    holds a recomputed tensor (the filter gradient, which reads the recomputed
    input), both are alive at once and the peak moves from run to run.  When
    every gradient reads a recomputed tensor, waiting frees nothing, so those
    are left alone.  This is TensorFlow's ``gate_gradients=True`` for these
    ops only, from control inputs instead of a ``tuple`` of identities.

    A copy named *late* waits later instead: the ops built on the gradients of
    the copy it is paired with (the next gated copy the backward pass
    differentiates, maybe in a later step) wait for its gradients, so its
    filter gradient runs beside the input-gradient chain below it, as in plain
    ``tf.gradients``.  The memory model decides which copies may wait late
    (:func:`.simulate.step_order`); this class only builds what it is told.
    Late waits are added by :meth:`finish`, once the pair's gradients exist.

    Control inputs only, no new ops.  A wait only points from gradient ops to
    ops created after all of them, which are none of their ancestors: it
    cannot close a cycle.
    """

    def __init__(self):
        self._gates: dict = {}  # copy -> _Gate

    @contextlib.contextmanager
    def recording(self, copies: Iterable[tf.Operation],
                  late: Iterable[tf.Operation] = ()) -> Iterator[None]:
        """Inside the block ``tf.gradients`` notes the gradients of ``copies``; on leaving
        it, the mixed ones of each copy not in ``late`` wait for each other."""
        late = frozenset(late)
        recorded: list = []
        copies = frozenset(copies)
        graph = next(iter(copies)).graph if copies else None
        with _wrapped_gradients(
                copies, lambda function: _recording_gradient(function, recorded, copies)):
            yield
        last_id = graph_lib.last_op_id(graph) if graph is not None else 0
        for op, producers, newest_id, mixed in recorded:
            gate = self._gates[op] = _Gate(producers, newest_id, last_id, mixed)
            if mixed and op not in late:
                gate.wait_for_each_other()

    def finish(self, pairs: dict) -> None:
        """Adds the late waits, ``pairs``: each late copy -> its pair (None: none was
        built), whose gradients' consumers wait for the late copy's gradients; a late
        copy without a pair that built gradients waits on its own."""
        for op, pair in pairs.items():
            gate = self._gates.get(op)
            if gate is None or not gate.mixed:
                continue
            paired = self._gates.get(pair)
            if paired is not None:
                paired.wait(lambda producer, gate=gate: list(gate.producers))
            else:
                gate.wait_for_each_other()


@contextlib.contextmanager
def gated_gradients(copies: Iterable[tf.Operation]) -> Iterator[None]:
    """Inside the block, ``tf.gradients`` gates the gradients of ``copies`` that are
    mixed (see :class:`GradientGates`): each waits for the others of its copy."""
    with GradientGates().recording(copies):
        yield


def _recording_gradient(function, recorded: list, copies: frozenset):
    """``function``, noting the ops of the gradients it returns, the newest of their ids,
    and whether they are mixed: two or more, of which some read a recomputed tensor
    and some do not."""

    def gradient(op, *output_gradients):
        results = function(op, *output_gradients)
        parts = results if isinstance(results, (list, tuple)) else [results]
        producers = _unique_ops(
            t.op for g in parts if g is not None for t in tensors_of(g)
            if isinstance(t, tf.Tensor)
        )
        if producers:
            mixed = False
            if len(producers) > 1:
                # ops with larger ids than op and its output gradients were made by the
                # gradient function; an op created after all of them is none of their
                # ancestors
                made_after = max([graph_lib.op_order(op)] + [
                    graph_lib.op_order(t.op) for g in output_gradients if g is not None
                    for t in tensors_of(g) if isinstance(t, tf.Tensor)])
                # an incoming gradient handed on as it is (a bias add's input gradient)
                # was made before: it reads nothing now, and waiting for or on it frees
                # nothing (it split oneDNN's filter-and-bias gradient fusion)
                reads = [graph_lib.op_order(p) > made_after
                         and _reads_recomputed(p, copies, made_after) for p in producers]
                mixed = any(reads) and not all(reads)
            recorded.append((op, producers, max(graph_lib.op_order(p) for p in producers), mixed))
        return results

    return gradient


def _reads_recomputed(producer: tf.Operation, copies: frozenset, made_after: int) -> bool:
    """Whether ``producer`` or an op the gradient function made for it reads the values
    of an output of one of ``copies`` (a shape is no read: it holds no buffer)."""
    stack, seen = [producer], set()
    while stack:
        current = stack.pop()
        if current in seen or current.type in op_types.SHAPE_ONLY_READERS:
            continue
        seen.add(current)
        for t in current.inputs:
            if t.op in copies:
                return True
            if graph_lib.op_order(t.op) > made_after:
                stack.append(t.op)
    return False


@contextlib.contextmanager
def closures_read_copies(copies: dict, running: Collection[tf.Operation]) -> Iterator[None]:
    """Inside the block, the gradient of each copied ``tf.custom_gradient`` op reads the
    copies of the forward tensors its Python closure reads, where those copies run
    (``running``: the originals' ops; ``copies``: original tensor ref -> copy).  The
    closure holds the tensors the forward pass made (its arguments, tensors made inside
    the function: the docstring's ``log1pexp`` reads ``tf.exp(x)``), so the gradient of a
    copy read the originals, which stayed alive from the forward pass to the backward
    pass beside the copies: 16 such layers measured more than plain ``tf.gradients``.
    Value for value the copies are the originals."""
    custom = [op for op in _unique_ops(t.op for t in copies.values())
              if graph_lib.custom_gradient_arguments(op) is not None]
    with _wrapped_gradients(custom, lambda function: _reading_copies(function, copies, running)):
        yield


@contextlib.contextmanager
def _wrapped_gradients(ops: Iterable[tf.Operation], wrap) -> Iterator[None]:
    """Inside the block, ``tf.gradients`` differentiates each of ``ops`` that has a gradient
    function by ``wrap(function)``; each op's own override is put back after."""
    replaced = []
    for op in ops:
        try:
            function = _tf_internals.gradient_function(op)
        except LookupError:
            continue
        if function is None:
            continue
        replaced.append((op, _tf_internals.gradient_override(op)))
        _tf_internals.set_gradient_override(op, wrap(function))
    try:
        yield
    finally:
        for op, previous in replaced:
            _tf_internals.set_gradient_override(op, previous)


def _reading_copies(function, copies: dict, running: Collection[tf.Operation]):
    """``function``; then every op it made (newer than ``op`` and its output gradients)
    that reads an original tensor whose copy runs reads the copy instead."""

    def gradient(op, *output_gradients):
        made_after = max([graph_lib.op_order(op)] + [
            graph_lib.op_order(t.op) for g in output_gradients if g is not None
            for t in tensors_of(g) if isinstance(t, tf.Tensor)])
        results = function(op, *output_gradients)
        parts = results if isinstance(results, (list, tuple)) else [results]
        stack = [t.op for g in parts if g is not None for t in tensors_of(g)
                 if isinstance(t, tf.Tensor)]
        seen = set()
        while stack:
            current = stack.pop()
            if current in seen or graph_lib.op_order(current) <= made_after:
                continue
            seen.add(current)
            for index, t in enumerate(list(current.inputs)):
                copy = copies.get(t.ref()) if t.op in running else None
                if copy is not None:
                    _tf_internals.update_input(current, index, copy)
                else:
                    stack.append(t.op)
        return results

    return gradient


def _copied_attrs(op: tf.Operation) -> dict:
    """The attrs of ``op`` for its copy, less the mark a v1 ``xla.compile`` context sets itself."""
    attrs = dict(op.node_def.attr)
    attrs.pop("_xla_compile_id", None)
    return attrs


def read_kept_outputs(ops: Sequence[tf.Operation], copies: dict, running: set,
                      read_kept: Collection, made_after: int) -> int:
    """Where a gradient built after op id ``made_after`` reads the copy of a kept tensor
    whose copy need not run (its op is not in ``running``; the tensor is in
    ``read_kept``), it reads the kept tensor instead, so that grappler prunes the copy
    (see :func:`.graph.copies_that_run`).  Returns how many inputs it rerouted."""
    rerouted = 0
    for op in ops:
        if op in running:
            continue
        for t in op.outputs:
            copy = copies.get(t.ref())
            if copy is None or t.ref() not in read_kept:
                continue
            for consumer in list(copy.consumers()):
                if _tf_internals.op_id(consumer) <= made_after:
                    continue
                for index, read in enumerate(consumer.inputs):
                    if read is copy:
                        _tf_internals.update_input(consumer, index, t)
                        rerouted += 1
    return rerouted


def add_control_inputs(ops: Iterable[tf.Operation], deps: Sequence[tf.Operation]) -> None:
    """Make each of ``ops`` (which this library just created) wait for ``deps``."""
    deps = _unique_ops(deps)
    for op in ops:
        missing = [d for d in deps if d is not op and d not in op.control_inputs]
        if missing:
            _tf_internals.add_control_inputs(op, missing)


def default_grad_ys(
    grad_ys: Sequence, ys: Sequence[tf.Tensor], colocate_gradients_with_ops: bool
) -> list:
    """TensorFlow's own filling of ``grad_ys`` (ones where None) and its type checks."""
    uid = tf.compat.v1.get_default_graph().unique_name("uid")
    return _tf_internals.default_grad_ys(list(grad_ys), list(ys), colocate_gradients_with_ops, uid)


def sum_gradients(
    grads: Sequence[tf.Tensor | tf.IndexedSlices], colocate_with: tf.Operation | None = None,
    aggregation_method: int | None = None, built_after: int | None = None,
) -> tf.Tensor | tf.IndexedSlices:
    """Sum gradient contributions like ``tf.gradients``: sparse stays sparse.

    If every contribution is an ``IndexedSlices`` the result is their
    concatenation; otherwise all are made dense and added: by one ``AddN``,
    or, for the tree ``aggregation_method``s, two at a time in the order
    given (each contribution can be freed once added), as ``tf.gradients`` does.

    A contribution that is itself a sum, made after the op id ``built_after`` (by the
    backward pass, not the user), is kept from grappler's folding of sums into their
    reader (see :func:`_summed`), so that it runs when its parts are made.
    """
    if len(grads) == 1:
        return grads[0]
    scope = (
        _tf_internals.colocate_with(colocate_with, ignore_existing=True)
        if colocate_with is not None
        else contextlib.nullcontext()
    )
    with scope:
        if all(isinstance(g, tf.IndexedSlices) for g in grads):
            dense_shape = next(
                (g.dense_shape for g in grads if g.dense_shape is not None), None
            )
            return tf.IndexedSlices(
                tf.concat([g.values for g in grads], axis=0),
                tf.concat([g.indices for g in grads], axis=0),
                dense_shape,
            )
        dense = [tf.convert_to_tensor(g) for g in grads]
        if aggregation_method in (
            tf.AggregationMethod.EXPERIMENTAL_TREE,
            tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N,
        ):
            running = dense[0]
            for g in dense[1:]:
                running = _summed([running, g], built_after)
            return running
        return _summed(dense, built_after)


#: The op types grappler's arithmetic optimizer folds into a sum that reads them.
_SUM_OP_TYPES = frozenset({"Add", "AddV2", "AddN"})


def _summed(parts: list, built_after: int | None) -> tf.Tensor:
    """``tf.math.add_n(parts)``, each part that is a sum kept as built.

    Grappler folds a sum whose only reader is another sum into that one, so that
    every part waits for the last of them all (a variable read's gradients into the
    variable's, over every step of an unrolled loop).  The parts that are sums, made
    after the op id ``built_after`` (never a user's op), are marked to stay
    (:func:`._tensorflow.preserve_from_grappler`); the new sum is not, so that grappler
    still prunes it where nothing reads it (a gradient not used).
    """
    for part in parts:
        if (part.op.type in _SUM_OP_TYPES and built_after is not None
                and graph_lib.op_order(part.op) > built_after):
            _tf_internals.preserve_from_grappler(part.op)
    return tf.math.add_n(parts)


def tensors_of(gradient: Gradient) -> list:
    """The tensors a gradient (dense or ``IndexedSlices``) is made of."""
    if isinstance(gradient, tf.IndexedSlices):
        parts = [gradient.values, gradient.indices]
        if gradient.dense_shape is not None:
            parts.append(gradient.dense_shape)
        return parts
    return [gradient]


def _unique_ops(ops: Iterable[tf.Operation]) -> list:
    seen: set = set()
    unique = []
    for op in ops:
        if op not in seen:
            seen.add(op)
            unique.append(op)
    return unique


def unused_output_gradient(t: tf.Tensor) -> tf.Tensor | None:
    """What ``tf.gradients`` gives for output ``t`` of an op it differentiates, when no
    gradient reaches ``t``: zeros if ``t`` is trainable and the op has a gradient, else None."""
    try:
        has_gradient = _tf_internals.gradient_function(t.op) is not None
    except LookupError:
        has_gradient = False
    if not (has_gradient and _tf_internals.is_trainable(t)
            and _tf_internals.supports_default_grad(t)):
        return None
    with _tf_internals.name_scope(t.op.name + "_grad"):
        return _tf_internals.zeros_like_output(t.op, t.value_index)


def zeros_like_gradient(x: tf.Tensor) -> tf.Tensor:
    """What ``tf.gradients`` returns for an unconnected ``x`` with ``unconnected_gradients='zero'``."""
    return _tf_internals.zeros_like_unconnected(x)


def proxies(
    tensors: Sequence[tf.Tensor],
    name_scope: str,
    control_inputs: Sequence[tf.Operation] = (),
    data_after: Sequence[tf.Tensor | tf.IndexedSlices] = (),
) -> dict:
    """An identity of each tensor, keyed by the original's ``ref()``, waiting for ``control_inputs``.

    Copies read the kept tensors through these, so that differentiating the
    copies with respect to them walks only the copies, never the rest of the
    original graph (which would make every segment cost the whole graph).
    The copies themselves then need no control inputs: grappler skips some
    optimizations of ops that have them, and one of its rewrites (``Pow`` with
    exponent 3 into ``Square`` times its input) fails on such an op in TF 2.21,
    which makes the whole graph go unoptimized.

    ``data_after`` (gradients, dense or ``IndexedSlices``), when given, is for
    graphs built for XLA, which drops control inputs and merges a copy with
    the op it copies: each float or complex proxy is then ``tensor + zero``,
    where the zero is computed from one element of the first of these
    gradients in a way XLA cannot fold, so the copies can neither run before
    that gradient nor be merged with the forward pass.  Other dtypes keep a
    plain identity.  Without ``data_after`` every proxy is a plain identity, ordered by
    its control inputs only.

    Grappler's arithmetic optimizer reorders a cast-like op and an identity so that
    the identity moves the narrower tensor: an identity of a widening cast would then
    hold the cast's input, and a narrowing cast of an identity would run before it,
    without its waits.  So the identity of a widening cast is kept from grappler
    (``_grappler_do_not_remove``), and :func:`copy_ops` gives a narrowing copy of a
    proxy the proxy's waits.
    """
    if not tensors:
        return {}
    with clean_scope(tensors[0].graph, name_scope):
        flag = _unfoldable_false(data_after) if data_after else None
        zeros: dict = {}
        made = {}
        for t in tensors:
            dtype = t.dtype.base_dtype
            if flag is not None and (dtype.is_floating or dtype.is_complex):
                if dtype not in zeros:
                    zeros[dtype] = tf.cast(flag, dtype, name="zero")
                made[t.ref()] = tf.math.add(t, zeros[dtype], name="proxy")
            else:
                made[t.ref()] = tf.identity(t)
                if _cast_widening(t.op) > 0:
                    # else grappler moves the cast past the identity, which then holds
                    # the cast's narrower input instead of the planned tensor
                    _tf_internals.preserve_from_grappler(made[t.ref()].op)
    waits = _unique_ops(control_inputs)
    if waits:
        for proxy in made.values():
            # not tf.control_dependencies: it would mark the waited-for ops
            # (originals) with an attribute, changing their NodeDefs
            _tf_internals.add_control_inputs(proxy.op, waits)
    return made


def _cast_widening(op: tf.Operation) -> int:
    """How many bytes a cast-like ``op`` (:data:`.ops.CAST_LIKE`) adds to each element:
    positive where it widens, negative where it narrows; 0 for any other op."""
    if op.type not in op_types.CAST_LIKE or not op.inputs or not op.outputs:
        return 0
    return op.outputs[0].dtype.base_dtype.size - op.inputs[0].dtype.base_dtype.size


def _unfoldable_false(gradients: Sequence) -> tf.Tensor | None:
    """A boolean False that depends on one element of the first float/complex gradient.

    ``b != b`` for ``b = bool(g[0])`` is False whatever ``g`` holds (NaN
    included), but XLA's simplifier does not fold it.  An empty gradient
    reads as -inf (``reduce_max`` of nothing), still a valid bool.  None when
    no gradient is float or complex.
    """
    for g in gradients:
        parts = tensors_of(g)
        if not parts:
            continue
        t = parts[0]
        dtype = t.dtype.base_dtype
        if not (dtype.is_floating or dtype.is_complex):
            continue
        if dtype.is_complex:
            t = tf.math.real(t)
        element = tf.reduce_max(tf.reshape(t, [-1])[:1])
        b = tf.cast(element, tf.bool)
        return tf.math.not_equal(b, b)
    return None


def _named_here(output_grads: Sequence, op: tf.Operation, colocate: bool) -> list:
    """The given gradients through identities in the current name scope, as ``tf.gradients``
    passes its ``grad_ys``: a v1 ``TensorArray``'s gradient finds its accumulator by the
    scope of the gradient it receives, so every gradient of one call must come from its
    scope (else the loop's writes and the stack after it get different accumulators).
    Only those ops get them (:data:`.ops.GRADIENT_FINDS_ACCUMULATOR_BY_NAME`): each
    identity is a node the step runs."""
    outputs = op.outputs
    given = [i for i, g in enumerate(output_grads) if g is not None]
    grads = list(output_grads)
    if given and op.type in op_types.GRADIENT_FINDS_ACCUMULATOR_BY_NAME:
        named = default_grad_ys([grads[i] for i in given], [outputs[i] for i in given], colocate)
        for i, g in zip(given, named):
            grads[i] = g
    return grads


def op_gradients(
    op: tf.Operation,
    output_grads: Sequence,
    gate_gradients: bool = False,
    colocate_gradients_with_ops: bool = False,
) -> list:
    """One step of ``tf.gradients``: the gradients of ``op``'s inputs, in place.

    ``output_grads`` has one entry per output (None where no gradient flows:
    zeros are used, as ``tf.gradients`` does).  Raises LookupError, naming
    the op, when its type has no registered gradient.
    """
    try:
        grad_fn = _tf_internals.gradient_function(op)
    except LookupError:
        raise LookupError(
            f"No gradient defined for operation '{op.name}' (op type: {op.type})."
        ) from None
    if grad_fn is None:
        return [None] * len(op.inputs)
    grads = _named_here(output_grads, op, colocate_gradients_with_ops)
    for i, g in enumerate(grads):
        output = op.outputs[i]
        if g is None and _tf_internals.is_trainable(output) and (
            _tf_internals.supports_default_grad(output)
        ):
            grads[i] = _tf_internals.zeros_like_output(op, i)
    graph = op.graph
    uid = graph.unique_name("uid")
    colocation = (
        _tf_internals.colocate_with_for_gradient(op, uid)
        if colocate_gradients_with_ops
        else contextlib.nullcontext()
    )
    with colocation, _tf_internals.name_scope(op.name + "_grad"), (
            _tf_internals.original_op_scope(graph, op)):
        in_grads = grad_fn(op, *grads)
    in_grads = list(in_grads) if isinstance(in_grads, (list, tuple)) else [in_grads]
    if gate_gradients and len([g for g in in_grads if g is not None]) > 1:
        with _tf_internals.device_scope(None):
            in_grads = _tf_internals.gated_tuple(in_grads)
    for i, (t, g) in enumerate(zip(op.inputs, in_grads)):
        if isinstance(g, tf.Tensor) and t.dtype != tf.resource:
            try:  # as tf.gradients: a gradient must fit its input (e.g. grad_ys' shapes)
                g.set_shape(t.shape)
            except ValueError:
                raise ValueError(
                    "Incompatible shapes between op input and calculated input gradient. "
                    f"Forward operation: {op.name}. Input index: {i}. Original input shape: "
                    f"{t.shape}. Calculated input gradient shape: {g.shape}"
                ) from None
    return in_grads


# -- what TensorFlow's gradient functions were called with and returned ----------


class GradientCalls:
    """What the gradient functions of ``graph``'s ops received and returned.

    ``calls[op]`` is ``(output kinds, input kinds)`` for the user's op ``op``
    (a recomputed copy counts as the op it copies), where a kind is
    ``'none'``, ``'sparse'`` (``IndexedSlices``) or ``'dense'``.  An op whose
    gradient function ran twice keeps the larger kind of each.
    """

    def __init__(self, graph: tf.Graph):
        self.graph = graph
        self.calls: dict = {}
        self.originals: dict = {}  # copy -> the op it copies

    def note(self, op: tf.Operation, output_gradients: Sequence[Gradient],
             input_gradients: Gradient | Sequence[Gradient]) -> None:
        original = self.originals.get(op, op)
        outs = tuple(gradient_kind(g) for g in output_gradients)
        parts = input_gradients if isinstance(input_gradients, (list, tuple)) else [input_gradients]
        ins = tuple(gradient_kind(g) for g in parts)
        seen = self.calls.get(original)
        if seen is not None and len(seen[0]) == len(outs) and len(seen[1]) == len(ins):
            outs = tuple(max(a, b, key=KIND_ORDER.index) for a, b in zip(seen[0], outs))
            ins = tuple(max(a, b, key=KIND_ORDER.index) for a, b in zip(seen[1], ins))
        self.calls[original] = (outs, ins)


KIND_ORDER = ("none", "sparse", "dense")


def gradient_kind(gradient: Gradient) -> str:
    """``'none'``, ``'sparse'`` (an ``IndexedSlices``) or ``'dense'``."""
    if gradient is None:
        return "none"
    if isinstance(gradient, tf.IndexedSlices):
        return "sparse"
    return "dense"


_observing = threading.local()  # this thread's stack of GradientCalls
_patch_lock = threading.Lock()
_patch_users = 0
_ORIGINAL_GET_GRADIENT_FUNCTION = _tf_internals.ORIGINAL_GRADIENT_FUNCTION_LOOKUP


def _current_calls():
    stack = getattr(_observing, "stack", None)
    return stack[-1] if stack else None


# per graph, {copy: the op it copies} for every copy made (a copy of a copy: the first)
_originals: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()


def original_of(op: tf.Operation) -> tf.Operation | None:
    """The op ``op`` is a recomputed copy of, or None where it is no copy."""
    return _originals.get(op.graph, {}).get(op)


def _note_copy(copy: tf.Operation, original: tf.Operation) -> None:
    calls = _current_calls()
    if calls is not None and copy.graph is calls.graph:
        calls.originals[copy] = calls.originals.get(original, original)


def _observing_get_gradient_function(op):
    function = _tf_internals.original_gradient_function(op)
    calls = _current_calls()
    if function is None or calls is None or op.graph is not calls.graph:
        return function

    def gradient(forward_op, *output_gradients):
        result = function(forward_op, *output_gradients)
        calls.note(forward_op, output_gradients, result)
        return result

    return gradient


def original_gradient_function(op: tf.Operation) -> GradientFunction | None:
    """TensorFlow's ``get_gradient_function``, never observed (LookupError as TensorFlow)."""
    return _tf_internals.original_gradient_function(op)


@contextlib.contextmanager
def observed_gradient_calls(graph: tf.Graph) -> Iterator[GradientCalls]:
    """Inside the block, the gradient functions TensorFlow calls on ``graph``'s ops in
    this thread are noted in the :class:`GradientCalls` yielded.

    ``ops.get_gradient_function`` (through which ``tf.gradients`` and
    :func:`op_gradients` find gradient functions) is wrapped while any thread
    observes; the wrapper is transparent to other threads and graphs.
    """
    global _patch_users
    calls = GradientCalls(graph)
    stack = getattr(_observing, "stack", None)
    if stack is None:
        stack = _observing.stack = []
    with _patch_lock:
        _patch_users += 1
        _tf_internals.replace_gradient_function_lookup(_observing_get_gradient_function)
    stack.append(calls)
    try:
        yield calls
    finally:
        stack.pop()
        with _patch_lock:
            _patch_users -= 1
            if not _patch_users:
                _tf_internals.replace_gradient_function_lookup(_ORIGINAL_GET_GRADIENT_FUNCTION)

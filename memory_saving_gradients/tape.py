"""Checkpointed ``GradientTape.gradient`` inside ``tf.function``.

Layer: entry points; imports: checkpointing, graph, notices, recovery, reporting,
_nesting, _tensorflow.

Inside a ``tf.function`` the operations a tape saw are ops of the function
graph, so ``gradient()`` can build the backward pass with
:func:`~memory_saving_gradients.gradients` on that graph instead of replaying
the tape.  Two ways in share the code of this module:

* :class:`GradientTape`, a ``tf.GradientTape`` subclass with its own
  ``checkpoints=`` and options;
* the tape-level patch (:mod:`.tape_hooks`, turned on by
  ``patch(tape=True)`` or ``keras.enable``), which makes every
  ``tf.GradientTape`` behave like it.

The result follows the tape's rules:

* only ops created while the tape was recording are differentiated through
  (tensors made before ``__enter__`` or under ``stop_recording()`` are
  constants for it, as for ``tf.GradientTape``);
* variables the tape did not watch, and tensors made outside the tape that
  were never ``watch``-ed, get ``None`` (or zeros with
  ``unconnected_gradients='zero'``);
* sources and the result may be nested structures (``tf.nest``).

The tape's own gradient is used, unchanged, where nothing can be rewritten
or where rewriting would change the meaning: eager mode (warned once per
process), composite targets or sources (ragged, sparse), ``jacobian`` and
``batch_jacobian``, a tape that started recording before the patch, and
tapes used by this library itself while it builds a backward pass (for
example the one inside ``tf.recompute_grad``'s gradient).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from . import _tensorflow as _tf_internals
from . import graph as graph_lib
from . import notices, recovery, reporting
from ._nesting import Nesting
from ._tensorflow import tf
from .checkpointing import Checkpoints, building_gradients, check_arguments, check_output_gradients
from .checkpointing import gradients as _checkpointed_gradients

logger = logging.getLogger("memory_saving_gradients")

#: A ``tf.nest`` structure: a tensor or variable, or lists, tuples and dicts of them.
Nested = Any

_eager_warned = threading.Event()
#: Inside ``jacobian``/``batch_jacobian`` (in this thread) tape gradients stay plain.
plain_gradients = Nesting()

#: The ``tf.GradientTape`` methods that :func:`hooked_methods` stands in for.
HOOKED = ("_push_tape", "_pop_tape", "reset", "watch", "gradient", "jacobian", "batch_jacobian")
#: TensorFlow's own GradientTape methods, captured before any hook is installed.
ORIGINAL = {name: _tf_internals.GRADIENT_TAPE.__dict__[name] for name in HOOKED}


@dataclasses.dataclass(frozen=True)
class Config:
    """What a checkpointed tape passes to :func:`gradients`."""

    checkpoints: object = "memory"
    options: tuple = ()  # sorted (name, value) pairs
    #: where the rewrites made with this configuration are recorded
    record: object = dataclasses.field(default=None, compare=False, hash=False)

    #: Parameters of gradients() that the tape passes itself (not options).
    PASSED_BY_THE_TAPE = ("stop_gradients", "unconnected_gradients")

    @classmethod
    def of(cls, checkpoints: Checkpoints, options: dict, record: reporting.Record | None = None) -> "Config":
        """A configuration; raises at once, as gradients() would, on a bad
        strategy, option name or option value."""
        check_arguments(checkpoints, options, cls.PASSED_BY_THE_TAPE)
        return cls(checkpoints, tuple(sorted(options.items())), record)


class _Recording:
    """Which ops of one graph a tape recorded: spans of op creation ids."""

    def __init__(self, graph):
        self.graph = graph
        self.ranges: list = []  # [first op id, last op id], per span
        self.open_from = None  # first op id of the span being recorded
        self.watched: dict = {}  # tensor.ref() -> tensor
        # the placeholders of captured eager sources that were never watched: no gradient
        self.unwatched_captures: set = set()

    def open(self) -> None:
        self.open_from = graph_lib.last_op_id(self.graph) + 1

    def close(self) -> None:
        if self.open_from is not None:
            self.ranges.append((self.open_from, graph_lib.last_op_id(self.graph)))
        self.open_from = None

    def recorded(self, op: tf.Operation) -> bool:
        """Whether a span recorded ``op``: a closed one, or the one still open (a
        ``gradient()`` called inside the ``with`` block)."""
        order = graph_lib.op_order(op)
        if self.open_from is not None and order >= self.open_from:
            return True
        return any(first <= order <= last for first, last in self.ranges)


_RECORDING = "_memory_saving_gradients_recording"


def _recording(tape):
    return tape.__dict__.get(_RECORDING)


# -- bookkeeping called after the tape's own methods ---------------------------


def note_push(tape: tf.GradientTape) -> None:
    """After ``_push_tape``: start a span of recorded ops (graph mode only).  Not inside
    ``jacobian``/``batch_jacobian``: they record for their own plain gradients, in a loop
    body's graph without pfor, and the tape's recording goes on after them."""
    if tf.executing_eagerly() or plain_gradients.active():
        return
    graph = tf.compat.v1.get_default_graph()
    recording = _recording(tape)
    if recording is None or recording.graph is not graph:
        recording = tape.__dict__[_RECORDING] = _Recording(graph)
    recording.open()


def note_pop(tape: tf.GradientTape) -> None:
    """After ``_pop_tape``: close the span (not inside ``jacobian``: see :func:`note_push`)."""
    if plain_gradients.active():
        return
    recording = _recording(tape)
    if recording is not None:
        recording.close()


def note_reset(tape: tf.GradientTape) -> None:
    """After ``reset``: forget what was recorded."""
    recording = _recording(tape)
    if recording is not None and not tf.executing_eagerly():
        tape.__dict__[_RECORDING] = fresh = _Recording(recording.graph)
        fresh.open()


def note_watch(tape: tf.GradientTape, tensor: Nested) -> None:
    """After ``watch``: remember watched graph tensors."""
    recording = _recording(tape)
    if recording is None or tf.executing_eagerly():
        return
    for t in tf.nest.flatten(tensor):
        if isinstance(t, tf.Tensor):
            recording.watched[t.ref()] = t


_INSIDE_THE_LIBRARY = "inside the library"
#: Why a gradient whose target no recorded op made is the tape's own.
OFF_THE_RECORDING = ("a target that no op recorded by the tape made (computed after its "
                     "with block, or linked by tape.record_operation as a "
                     "ForwardAccumulator's helpers do)")
#: Why a gradient none of whose sources the tape saw builds nothing.
NO_SOURCE_ON_THE_TAPE = ("no source the tape watched or recorded (a variable it did not "
                         "watch, a tensor made outside it and not watched): every "
                         "gradient is None, as the tape's own")
#: Why a gradient with no sources at all (a model without weights) builds nothing.
NO_SOURCES = "no sources (an empty list: a model without trainable weights): nothing to differentiate"
_AUTOGRAPH_STAGING = "autograph's throwaway trace of a loop body"
_FORWARDPROP_HELPER = "a ForwardAccumulator's per-op helper"
#: Reasons for a plain gradient that are not the user's to know: nothing is reported.
_SILENT_REASONS = (_INSIDE_THE_LIBRARY, _AUTOGRAPH_STAGING, _FORWARDPROP_HELPER)


def _plain_reason(tape) -> str | None:
    """Why this gradient call must be the tape's own, or None."""
    if plain_gradients.active():
        return "jacobian"
    if building_gradients():
        return _INSIDE_THE_LIBRARY
    if _tf_internals.in_forwardprop_helper_trace():
        # its tapes are linked by record_gradient, not by ops, and what it traces is
        # cached for the whole process: it must be TensorFlow's own, patched or not
        return _FORWARDPROP_HELPER
    if _tf_internals.in_autograph_staging_trace():
        # a loop variable first set in the body: the body is traced once to learn its
        # type, in a graph that never runs, then again for real (planned there)
        return _AUTOGRAPH_STAGING
    if _recording(tape) is None:
        return "the tape started recording before memory-saving gradients were turned on"
    return None


# -- the checkpointed gradient ---------------------------------------------------


def checkpointed_gradient(
    tape: tf.GradientTape,
    config: Config,
    target: Nested,
    sources: Nested,
    output_gradients: Nested | None = None,
    unconnected_gradients: tf.UnconnectedGradients | str = tf.UnconnectedGradients.NONE,
) -> Nested:
    """``tape.gradient(...)`` built by :func:`gradients` on the recorded graph."""

    def plain():
        return ORIGINAL["gradient"](tape, target, sources, output_gradients, unconnected_gradients)

    if _stays_plain(tape, config):
        return plain()
    if target is None:
        error = TypeError(
            "Argument `target` should be a list or nested structure of Tensors, "
            "Variables or CompositeTensors to be differentiated, but received None."
        )
        reporting.raised(error, config.record, counted=False)
        raise error
    flat_targets = tf.nest.flatten(target)
    flat_sources = tf.nest.flatten(sources)
    recording = _recording(tape)
    flat_sources = [_in_graph(s, recording) for s in flat_sources]
    why_not = _why_not_rewritable(flat_targets + flat_sources, recording.graph)
    if why_not is not None:
        logger.warning("%s; using tf.GradientTape's own gradient "
                       "(no memory saved).", why_not)
        reporting.left_plain(config.record, why_not, tf.compat.v1.get_default_graph())
        return plain()
    if _tf_internals.tape_is_used_up(tape):
        error = RuntimeError(
            "A non-persistent GradientTape can only be used to compute one set "
            "of gradients (or jacobians)"
        )
        reporting.raised(error, config.record, counted=False)
        raise error
    ys = [_as_target(t) for t in flat_targets]
    graph = ys[0].graph
    if graph is not recording.graph:
        logger.debug("target not in the tape's graph; plain gradient")
        return plain()
    if not all(is_variable(value) or _on_tape(y, recording)
               for value, y in zip(flat_targets, ys)):
        # The tape links such a target to its sources only where something recorded it
        # without an op of the recording (tape.record_operation: a ForwardAccumulator's
        # helpers do); TensorFlow's own gradient follows that record, or gives None
        # (a loss computed after the with block), as the tape's rules say.
        logger.debug("a target no recorded op made: the tape's own gradient")
        reporting.left_plain(config.record, OFF_THE_RECORDING, graph)
        if isinstance(tape, GradientTape):  # asked for by name: say so now (a patch says
            notices.warn(                    # it when undone)
                f"memory_saving_gradients.GradientTape rewrote nothing: {OFF_THE_RECORDING}; "
                "its gradient is tf.GradientTape's own (None where nothing recorded links "
                "the target to a source).", notices.NothingRewrittenWarning)
        return plain()
    watched = _end_recording(tape, recording)
    grad_ys = None
    if output_gradients is not None:
        grad_ys = [
            None if g is None else tf.convert_to_tensor(g)
            for g in tf.nest.flatten(output_gradients)
        ]
        try:
            check_output_gradients(grad_ys, ys)
        except (TypeError, ValueError) as error:
            reporting.raised(error, config.record, counted=False)
            raise
    results = _source_gradients(config, ys, grad_ys, flat_sources, recording, watched,
                                unconnected_gradients)
    return tf.nest.pack_sequence_as(sources, results)


def _on_tape(target: tf.Tensor, recording: _Recording) -> bool:
    """Whether the tape differentiates from ``target``: an op it recorded made it, or it
    watched it.  A target made outside the tape (a loss computed after the ``with``
    block) gives no gradient, as with ``tf.GradientTape``."""
    return recording.recorded(target.op) or target.ref() in recording.watched


def _source_gradients(config: Config, ys: list, grad_ys, flat_sources: list,
                      recording: _Recording, watched: set, unconnected_gradients) -> list:
    """One gradient per source, by :func:`gradients` from ``ys`` on the recorded ops;
    None (zeros with ``unconnected_gradients='zero'``) where the tape gives none."""
    connected, xs = _recorded_sources(flat_sources, recording, watched)
    results = [None] * len(flat_sources)
    if ys and not flat_sources:
        reporting.left_plain(config.record, NO_SOURCES, ys[0].graph)
    elif ys and not xs:
        reporting.left_plain(config.record, NO_SOURCE_ON_THE_TAPE, ys[0].graph)
    if xs and ys:
        options = dict(config.options)
        with reporting.recording(config.record):
            grads = _checkpointed_gradients(
                ys,
                xs,
                grad_ys,
                checkpoints=config.checkpoints,
                stop_gradients=_unrecorded_inputs(recording, ys, xs) or None,
                unconnected_gradients=unconnected_gradients,
                **options,
            )
        for i, g in zip(connected, grads):
            results[i] = g
    if tf.UnconnectedGradients(unconnected_gradients) == tf.UnconnectedGradients.ZERO:
        for i, s in enumerate(flat_sources):
            if results[i] is None:
                results[i] = tf.zeros_like(s)
    return results


def _stays_plain(tape, config: Config) -> bool:
    """Whether this gradient call must be the tape's own (eager, jacobian, inside the
    library, a tape older than the patch); says so where the user should hear it."""
    if tf.executing_eagerly() and _tf_internals.running_in_py_function():
        # TensorFlow's own eager tape (a py_function's gradient), or the user's inside
        # a py_function: eager by design, nothing to rewrite, nothing to advise
        reporting.left_plain(config.record, "eager inside a tf.py_function")
        return True
    if tf.executing_eagerly():
        reporting.ran_eagerly(config.record)
        if not _eager_warned.is_set():
            _eager_warned.set()
            notices.warn(
                "memory_saving_gradients: GradientTape.gradient ran eagerly (outside a "
                "tf.function, or in a Keras model compiled with run_eagerly=True): "
                "nothing can be recomputed in eager mode, so these are plain "
                "tf.GradientTape gradients (no memory saved). Call it inside a "
                "tf.function (Keras: run_eagerly=False) to save memory. (Warned once.)",
                notices.EagerExecutionWarning
            )
        return True
    reason = _plain_reason(tape)
    if reason is not None:
        logger.debug("plain tape gradient (%s)", reason)
        if reason not in _SILENT_REASONS:
            reporting.left_plain(config.record, reason, tf.compat.v1.get_default_graph())
        return True
    return False


def _in_graph(source, recording: _Recording):
    """``source``, or where it is a tensor from outside the recorded graph that the graph
    reads (an eager tensor the traced function captured; a tensor of the function that
    a loop body or a ``cond`` branch captured), the placeholder the graph reads it
    through: its gradient is the source's, as the tape's own capture record says.  A
    watched one stays watched."""
    if not isinstance(source, tf.Tensor) or source.dtype in (tf.resource, tf.variant):
        # a variable's handle: the tape matches it to the variable it captured, which
        # the graph holds no op of to differentiate to
        return source
    if tf.is_symbolic_tensor(source) and source.graph is recording.graph:
        return source
    internal = _captured_through(recording.graph, source)
    if internal is None:
        return source
    if source.ref() in recording.watched:
        recording.watched[internal.ref()] = internal
    else:
        recording.unwatched_captures.add(internal.ref())
    return internal


def _captured_through(graph, value):
    """The tensor through which ``graph`` reads ``value``, a tensor from outside it:
    captured by ``graph`` itself, or through the function graphs between (a ``cond``
    branch in a loop body in a ``tf.function``); None where ``graph`` reads none."""
    outer = value.graph if tf.is_symbolic_tensor(value) else None  # None: eager
    between = []
    while graph is not outer and hasattr(graph, "captures"):
        between.append(graph)
        graph = getattr(graph, "outer_graph", None)
    if outer is not None and graph is not outer:
        return None  # not from a graph that encloses this one
    # a graph may capture the outer tensor itself or what a graph between captured it as
    # (a cond branch in a loop body captures the function's tensor before the body does)
    aliases, found = [value], None
    for inner in reversed(between):
        found = None
        for alias in list(aliases):
            internal = _tf_internals.captured_placeholder(inner, alias)
            if internal is not None:
                found = internal
        if found is not None:
            aliases.append(found)
    return found


def _why_not_rewritable(values: list, graph) -> str | None:
    """Why the tape's own gradient must be used, or None where every target and source
    is a tensor of ``graph`` (the recorded one) or a variable."""
    unsupported = [t for t in values if not (isinstance(t, tf.Tensor) or is_variable(t))]
    if unsupported:
        return (f"a target or source of GradientTape.gradient is a "
                f"{type(unsupported[0]).__name__}, not a dense tensor or variable")
    eager = [t for t in values if isinstance(t, tf.Tensor) and not tf.is_symbolic_tensor(t)]
    if eager:
        # a variable's handle, or an eager tensor the traced function never reads: the
        # graph holds no op of it to differentiate to
        return (f"a target or source of GradientTape.gradient is an eager tensor "
                f"({eager[0].dtype.name}): a variable's handle, or a tensor the traced "
                f"function does not read")
    elsewhere = [t for t in values if isinstance(t, tf.Tensor) and tf.is_symbolic_tensor(t)
                 and t.graph is not graph]
    if elsewhere:
        # a tensor of an enclosing graph that the recorded graph (a loop body, a cond
        # branch) does not read: nothing to differentiate to
        return (f"a target or source of GradientTape.gradient ({elsewhere[0].name}) is a "
                f"tensor of another graph that the recorded graph does not read")
    return None


def _end_recording(tape, recording: _Recording) -> set:
    """End what ``gradient()`` differentiates, as ``tf.GradientTape.gradient`` does: a
    non-persistent tape stops recording and is used up; a persistent one goes on in a
    new span.  Returns the keys (:func:`_handle_key`) of the variables it watched."""
    if _tf_internals.tape_is_recording(tape):
        if not _tf_internals.tape_is_persistent(tape):
            _tf_internals.stop_tape(tape)  # closes the span (the hooked _pop_tape)
        else:
            # Keep recording, but the ops made so far are what gets differentiated.
            recording.close()
            recording.open()
    watched = {_handle_key(v) for v in tape.watched_variables()}
    if not _tf_internals.tape_is_persistent(tape):
        _tf_internals.release_tape(tape)  # as tf.GradientTape: one gradient() per tape
    return watched


def _recorded_sources(flat_sources: list, recording: _Recording, watched: set) -> tuple:
    """``(indices, sources)`` of the sources the tape differentiates to: watched variables,
    and tensors it recorded or watched (the others get no gradient)."""
    connected, xs = [], []
    for i, s in enumerate(flat_sources):
        if is_variable(s):
            if _handle_key(s) in watched:
                connected.append(i)
                xs.append(s)
        elif s.ref() in recording.unwatched_captures:
            continue
        elif recording.recorded(s.op) or s.ref() in recording.watched:
            connected.append(i)
            xs.append(s)
    return connected, xs


def _unrecorded_inputs(recording: _Recording, ys: list, xs) -> list:
    """Tensors that recorded ops read, or targets the tape watched, made outside the tape.

    The tape does not differentiate through them, so neither do we: they go
    to ``stop_gradients`` (minus the xs themselves).
    """
    graph = ys[0].graph
    x_refs = {x.ref() for x in xs if isinstance(x, tf.Tensor)}
    stops: dict = {y.ref(): y for y in ys
                   if y.ref() in recording.watched and y.ref() not in x_refs
                   and graph_lib.carries_gradient(y) and not recording.recorded(y.op)}
    ops = graph.get_operations()
    for first, last in recording.ranges:
        for op in ops[_index_of_id(ops, first):]:
            if graph_lib.op_order(op) > last:
                break
            for t in op.inputs:
                if (
                    t.ref() not in x_refs
                    and graph_lib.carries_gradient(t)
                    and not recording.recorded(t.op)
                ):
                    stops.setdefault(t.ref(), t)
    return list(stops.values())


# -- the methods of a checkpointing tape ---------------------------------------------


def hooked_methods(previous: Callable[[str], Callable],
                   config_of: Callable[[tf.GradientTape], Config | None]) -> dict[str, Callable]:
    """The :data:`HOOKED` methods of a checkpointing tape, by name.

    Each calls ``previous(name)`` (the method it stands in for) and then does
    this module's bookkeeping; ``gradient`` goes through
    :func:`checkpointed_gradient` with ``config_of(tape)``, or to ``previous``
    where that is None; ``jacobian`` and ``batch_jacobian`` stay plain.  Used by
    :class:`GradientTape` (over TensorFlow's own methods) and by the tape-level
    patch of :mod:`.tape_hooks` (over whatever was installed before it).
    """

    def _push_tape(self):
        previous("_push_tape")(self)
        note_push(self)

    def _pop_tape(self):
        previous("_pop_tape")(self)
        note_pop(self)

    def reset(self):
        previous("reset")(self)
        note_reset(self)

    def watch(self, tensor):
        previous("watch")(self, tensor)
        note_watch(self, tensor)

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """As ``tf.GradientTape.gradient``; checkpointed inside a ``tf.function``."""
        config = config_of(self)
        if config is None:
            return previous("gradient")(self, target, sources, output_gradients,
                                        unconnected_gradients)
        return checkpointed_gradient(
            self, config, target, sources, output_gradients, unconnected_gradients
        )

    def jacobian(self, *args, **kwargs):
        with plain_gradients:
            return previous("jacobian")(self, *args, **kwargs)

    def batch_jacobian(self, *args, **kwargs):
        with plain_gradients:
            return previous("batch_jacobian")(self, *args, **kwargs)

    methods = {
        "_push_tape": _push_tape, "_pop_tape": _pop_tape, "reset": reset, "watch": watch,
        "gradient": gradient, "jacobian": jacobian, "batch_jacobian": batch_jacobian,
    }
    return methods


#: The subclass's methods: over TensorFlow's own (so a tape-level patch, which
#: replaces them on tf.GradientTape, never applies twice), with its own configuration.
_SUBCLASS_METHODS = hooked_methods(ORIGINAL.__getitem__, lambda tape: tape._config)


# -- the subclass ------------------------------------------------------------------


class GradientTape(tf.GradientTape):
    """Drop-in for ``tf.GradientTape`` that saves memory when used in a ``tf.function``.

    Args:
      checkpoints: strategy name (``'memory'``, ``'speed'``, ``'collection'``)
        or a list of tensors, as in :func:`memory_saving_gradients.gradients`.
      persistent, watch_accessed_variables: as in ``tf.GradientTape``.
      **options: more keyword arguments for ``gradients`` (``memory_budget``,
        ``batch_size``, ``gate_gradients``, ``aggregation_method``,
        ``colocate_gradients_with_ops``).

    Its ``jacobian`` and ``batch_jacobian`` are ``tf.GradientTape``'s own.
    A misspelled strategy or option raises here, as ``gradients`` would.
    ``plans`` lists the :class:`~memory_saving_gradients.Plan` of every
    backward pass it rewrote.
    """

    def __init__(
        self,
        checkpoints: Checkpoints = "memory",
        persistent: bool = False,
        watch_accessed_variables: bool = True,
        **options: Any,
    ):
        record = reporting.Record()
        try:
            config = Config.of(checkpoints, options, record)  # raises before anything is recorded
        except Exception:
            if not tf.executing_eagerly():
                recovery.after_failure()  # made inside a trace: it can trace again
            raise
        super().__init__(persistent=persistent, watch_accessed_variables=watch_accessed_variables)
        self.checkpoints = checkpoints
        self.options = options
        self.plans = record.plans
        self._config = config

    _push_tape = _SUBCLASS_METHODS["_push_tape"]
    _pop_tape = _SUBCLASS_METHODS["_pop_tape"]
    reset = _SUBCLASS_METHODS["reset"]
    watch = _SUBCLASS_METHODS["watch"]
    gradient = _SUBCLASS_METHODS["gradient"]
    jacobian = _SUBCLASS_METHODS["jacobian"]
    batch_jacobian = _SUBCLASS_METHODS["batch_jacobian"]


# -- helpers -----------------------------------------------------------------------


def is_variable(value: object) -> bool:
    """Whether TensorFlow treats ``value`` as a resource variable (tf.Variable,
    Keras 3 and tf_keras variables, AutoCastVariable, distributed variables)."""
    return _tf_internals.is_resource_variable(value)


def _handle_key(variable):
    """What the tape keys a variable by: its handle (a replica's, for a
    distributed variable in replica context)."""
    return id(variable.handle)


def _index_of_id(ops: list, op_id: int) -> int:
    """Index of the first op with creation id >= op_id (ops are in id order)."""
    lo, hi = 0, len(ops)
    while lo < hi:
        mid = (lo + hi) // 2
        if graph_lib.op_order(ops[mid]) < op_id:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _as_target(value) -> tf.Tensor:
    if is_variable(value):
        return tf.convert_to_tensor(value)
    return value

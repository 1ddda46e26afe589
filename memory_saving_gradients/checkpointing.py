"""``gradients()``: the checkpointed backward pass.

Layer: transform (one gradients() call end to end); imports: batch, graph, guard, memo,
notices, planning, recovery, reporting, rewrite, schedule, simulate, strategies,
_nesting, _tensorflow, _units.

Data flows one way: arguments are checked, the forward region between
``xs`` and ``ys`` is found (:mod:`.graph`), checkpoints are chosen (a list or
a strategy from :mod:`.strategies`), and the backward pass is built step
by step, in the order of :func:`.schedule.backward_schedule` (the one the
memory model replays): each step has the ops between its kept tensors and the
earlier kept tensors copied (:mod:`.rewrite`) and differentiated with
TensorFlow's own ``gradients``, after the gradient flowing into it is
complete.  Copies wait (control inputs) for that gradient, so recomputation
happens just before it is needed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import logging
import numbers
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from . import _gc, guard, memo, notices, planning, recovery, reporting, rewrite, simulate, size_ties, strategies, terms
from . import _tensorflow as _tf_internals
from . import batch as batch_lib
from . import graph as graph_lib
from . import ops as op_types
from . import schedule as schedule_lib
from ._nesting import Nesting
from ._tensorflow import gpu_visible, onednn_enabled, tf, tf_gradients
from ._tensorflow import is_resource_variable as _is_resource_variable
from ._units import MIB, describe_bytes

logger = logging.getLogger("memory_saving_gradients")

TensorOrList = Union[tf.Tensor, Sequence[tf.Tensor]]
Checkpoints = Union[str, Sequence[tf.Tensor]]
#: What ``xs`` may be: tensors or variables (``tf.Variable``, and the variables
#: ``tf.gradients`` takes through their tensor conversion: Keras 3 and tf_keras
#: variables, ``AutoCastVariable``, distributed variables), one or a sequence.
Sources = Union[tf.Tensor, tf.Variable, Sequence[Union[tf.Tensor, tf.Variable]]]
#: What ``grad_ys`` may be: one tensor, or one (or None) per y.
GradYs = Optional[Union[tf.Tensor, Sequence[Optional[tf.Tensor]]]]

#: Size assumed for an unknown dimension (a batch of ``None``) when planning,
#: unless ``batch_size=`` states it.
DEFAULT_BATCH_SIZE = 32

_inside_gradients = Nesting()  # gradients() calls running in this thread
# per graph, the backward passes gradients() built: ((ys names, xs names), first op id,
# last op id); plan() does not take them for another computation's backward pass
_built_backward: "weakref.WeakKeyDictionary[tf.Graph, list]" = weakref.WeakKeyDictionary()


def building_gradients() -> bool:
    """Whether this thread is inside :func:`gradients` (tapes used by TensorFlow's
    own gradient functions then stay plain: the library never recurses into itself)."""
    return _inside_gradients.active()


# Called from a tf.function, autograph would convert this library's code
# (slowly, and wrongly: it broke keyword calls and len() on lists).
@tf.autograph.experimental.do_not_convert
def gradients(
    ys: TensorOrList,
    xs: Sources,
    grad_ys: GradYs = None,
    checkpoints: Checkpoints = "collection",
    name: str = "gradients",
    colocate_gradients_with_ops: bool = False,
    gate_gradients: bool = False,
    aggregation_method: int | None = None,
    stop_gradients: TensorOrList | None = None,
    unconnected_gradients: tf.UnconnectedGradients | str = tf.UnconnectedGradients.NONE,
    memory_budget: int | None = None,
    batch_size: int | None = None,
) -> list:
    """Drop-in for ``tf.compat.v1.gradients`` that recomputes instead of storing.

    Args:
      ys, xs, grad_ys, name, colocate_gradients_with_ops, gate_gradients,
        aggregation_method, stop_gradients, unconnected_gradients: as in
        ``tf.compat.v1.gradients``.  xs may be tensors or any variable
        ``tf.compat.v1.gradients`` takes (``tf.Variable``, Keras 3 and
        tf_keras variables, ``AutoCastVariable``, distributed variables).
      checkpoints: the tensors to keep from the forward pass: a list of
        tensors, or a strategy name (``'collection'``: the graph collection
        ``'checkpoints'``; see ``strategies.available()`` for the others).
      memory_budget: bytes; for strategies that plan to a budget.  With
        unknown dimensions in the graph it needs ``batch_size``.
      batch_size: the size the planner assumes for unknown (``None``)
        dimensions, typically the batch you feed.  Default: 32 (and the plan's
        ``assumptions`` say so).  Only strategies use it.

    Returns:
      A list with one gradient per x: a tensor, an ``IndexedSlices`` where
      ``tf.gradients`` gives one, or None (zeros with
      ``unconnected_gradients='zero'``).

    Raises:
      TypeError, ValueError: bad arguments; the graph is left unchanged.
      RuntimeError: called eagerly (use it inside a ``tf.function``).
    """
    if tf.executing_eagerly():
        raise RuntimeError(
            "memory_saving_gradients.gradients works on graphs: call it inside a "
            "tf.function or a tf.compat.v1 graph. In eager code use "
            "memory_saving_gradients.GradientTape inside a tf.function."
        )
    reporting.called()
    try:
        with _gc.paused(), _tf_internals.gradient_types_remembered():
            return _gradients(
                ys, xs, grad_ys, checkpoints, name, colocate_gradients_with_ops, gate_gradients,
                aggregation_method, stop_gradients, unconnected_gradients, memory_budget,
                batch_size,
            )
    except Exception as error:
        reporting.raised(error)
        recovery.after_failure()  # the tf.function or Keras model being traced can trace again
        raise


#: Said where gradients() gets an unknown strategy name: its fourth argument is
#: ``checkpoints``, as in the original tool, where ``tf.gradients``' is ``name``.
_POSITIONAL_HINT = (
    "gradients()' fourth argument is checkpoints, where tf.compat.v1.gradients' is name: "
    "pass name= and what follows it by keyword, or call gradients_memory, gradients_speed "
    "or gradients_collection, which take tf.compat.v1.gradients' arguments in its order.")


def _gradients(
    ys, xs, grad_ys, checkpoints, name, colocate_gradients_with_ops, gate_gradients,
    aggregation_method, stop_gradients, unconnected_gradients, memory_budget, batch_size,
) -> list:
    """:func:`gradients` once it is known to run on a graph."""
    if isinstance(checkpoints, str):
        strategies.get(checkpoints, hint=_POSITIONAL_HINT)
    check_arguments(checkpoints, dict(memory_budget=memory_budget, batch_size=batch_size,
                                      aggregation_method=aggregation_method,
                                      unconnected_gradients=unconnected_gradients))
    options = dict(
        name=name,
        colocate_gradients_with_ops=colocate_gradients_with_ops,
        gate_gradients=gate_gradients,
        aggregation_method=aggregation_method,
        stop_gradients=stop_gradients,
        unconnected_gradients=unconnected_gradients,
    )
    unconnected = tf.UnconnectedGradients(unconnected_gradients)
    if not _as_list(xs) or not _as_list(ys):
        # nothing to differentiate: tf.gradients' own answer ([] for no xs; for no ys, a
        # None, or zeros, per x), as generic code (a model with no weights) expects
        reporting.called_plain("no xs or no ys: nothing to differentiate")
        return tf_gradients(ys, xs, grad_ys, **options)
    with _inside_gradients:
        problem = _prepare(ys, xs, stop_gradients)
        outer = _outer_differentiator(problem)
        if outer is not None:
            _say_outer_differentiator(problem, outer)
            reporting.called_plain(f"{outer} differentiates it (plain tf.gradients)",
                                   problem.graph)
            return _plain_for_tapes(problem.graph, ys, xs, grad_ys, options)
        missing = _op_without_gradient(problem)
        if missing is not None:
            # tf.gradients' own error (and only its ops), where a rewrite would build
            # hundreds of ops before that lookup failed
            reporting.called_plain(f"{missing.name} has no gradient", problem.graph)
            results = tf_gradients(ys, xs, grad_ys, **options)
            notices.warn(
                f"gradients() used plain tf.gradients: no gradient is registered for "
                f"{missing.name} ({missing.type}) as the rewrite looks it up, yet "
                "tf.gradients found one. No memory is saved.", notices.FallbackWarning)
            return results
        with problem.graph.as_default(), _remembered_backward(problem):
            stops = problem.stops
            grad_ys_list = _grad_ys_list(grad_ys, problem.ys)
            chosen = choose_checkpoints(
                checkpoints, problem.ys, problem.xs, problem.region, problem.graph,
                memory_budget, batch_size, stops,
            )
            reporting.planned(problem.graph)
            if chosen is None:
                return _plain_for_tapes(problem.graph, ys, xs, grad_ys, options)
            _warn_unmodelled_workspaces(problem.region)
            _warn_untied_sizes(problem)
            _warn_separate_terms(problem, batch_size)
            other_backward = _other_backward_note(problem)
            _warn_other_backward(problem.graph, other_backward)
            logger.debug("checkpoints: %s", [t.name for t in chosen])
            # the plan is made before the rewrite: it describes the forward graph as the
            # planner saw it, not one with the backward pass added
            made_plan = (_plan_of(checkpoints, problem, chosen, memory_budget, batch_size, stops,
                                  other_backward)
                         if reporting.wanted() else None)
            first = graph_lib.last_op_id(problem.graph) + 1
            with tf.name_scope(name or "gradients"):
                results = _backprop(_Request(
                    problem.ys, problem.xs, grad_ys_list, problem.region, chosen, stops,
                    _GradientOptions(colocate_gradients_with_ops, gate_gradients,
                                     aggregation_method, unconnected),
                    _unknown_dim(batch_size),
                ))
            _remember_rewrite(problem.graph, first, results)
            _record_for_outer_tapes(problem.graph, first, results)
            if made_plan is not None:
                reporting.rewrote(made_plan, problem.graph)
                _warn_if_list_raises_the_peak(made_plan)
            return results


@contextlib.contextmanager
def _remembered_backward(problem):
    """Remembers the ops built inside as the backward pass of ``problem``'s ys and xs."""
    first = graph_lib.last_op_id(problem.graph) + 1
    try:
        yield
    finally:
        last = graph_lib.last_op_id(problem.graph)
        if last >= first:
            _built_backward.setdefault(problem.graph, []).append(
                (_computation_key(problem), first, last))


def _computation_key(problem) -> tuple:
    return (tuple(t.name for t in problem.ys), tuple(t.name for t in problem.xs))


def _other_backward_note(problem) -> tuple:
    """:func:`simulate.other_backward_note` for ``problem``, or else
    :func:`simulate.concurrent_backward_note`, leaving out the backward passes this
    library built for the same ys and xs (a ``plan()`` after its ``gradients()``)."""
    key = _computation_key(problem)
    own = [(first, last) for built, first, last in _built_backward.get(problem.graph, ())
           if built == key]

    def elsewhere(op):
        order = graph_lib.op_order(op)
        return not any(first <= order <= last for first, last in own)

    return (simulate.other_backward_note(problem.region, elsewhere)
            or simulate.concurrent_backward_note(problem.region, elsewhere))


@tf.autograph.experimental.do_not_convert  # as gradients(): called from tf.function bodies
def plan(
    ys: TensorOrList,
    xs: Sources,
    checkpoints: Checkpoints = "memory",
    memory_budget: int | None = None,
    grad_ys: GradYs = None,
    batch_size: int | None = None,
    stop_gradients: TensorOrList | None = None,
) -> planning.Plan:
    """What ``gradients(ys, xs, grad_ys, checkpoints, memory_budget=..., batch_size=...,
    stop_gradients=...)`` would do.

    Returns a :class:`Plan` with the checkpoints, the memory model's predicted
    peaks (with them, and for plain ``tf.gradients``), the recomputation they
    cost and the backward schedule (``Plan.schedule``) that ``gradients()``
    builds.  Builds nothing in the graph.  ``grad_ys`` does not change the plan;
    it is accepted so that calls can mirror ``gradients()``.  ``gradients()``'
    other options (``name``, ``colocate_gradients_with_ops``, ``gate_gradients``,
    ``aggregation_method``, ``unconnected_gradients``) change how each step's
    gradients are taken, not the schedule or the memory model, and are not
    parameters here.
    """
    if tf.executing_eagerly():
        raise RuntimeError("plan() works on graphs: call it inside a tf.function or a v1 graph.")
    check_arguments(checkpoints, dict(memory_budget=memory_budget, batch_size=batch_size))
    problem = _prepare(ys, xs, stop_gradients)
    _grad_ys_list(grad_ys, problem.ys)
    missing = _op_without_gradient(problem)
    if missing is not None:
        raise LookupError(
            f"No gradient defined for operation {missing.name!r} (op type: {missing.type}), "
            "which lies between xs and ys: gradients() and tf.gradients raise there. "
            "Register one (tf.RegisterGradient), or put tf.stop_gradient where no gradient "
            "is needed.")
    stops = problem.stops
    with problem.graph.as_default():
        chosen = choose_checkpoints(
            checkpoints, problem.ys, problem.xs, problem.region, problem.graph,
            memory_budget, batch_size, stops,
        )
    return _plan_of(checkpoints, problem, chosen or [], memory_budget, batch_size, stops)


def _op_without_gradient(problem) -> tf.Operation | None:
    """The first op between xs and ys that a gradient from ys reaches and that has no
    gradient function (an unregistered type, a ``gradient_override_map`` to a name never
    registered), or None: where ``tf.gradients`` raises.  The walk goes back from ys
    through ops whose gradient is not None (not through ``tf.stop_gradient``, ``Shape``,
    ``stop_gradients``) along tensors that carry gradients; an op it does not reach
    (an ungradable resize under ``tf.stop_gradient``) is never looked up, as in
    ``tf.gradients``.  Function calls are differentiated by TensorFlow's own machinery."""
    region = problem.region
    stop_ops = {t.op for t in problem.stops}
    stack = [y.op for y in problem.ys if y.op in region]
    reached: set = set()
    while stack:
        op = stack.pop()
        if op in reached or op in stop_ops:
            continue
        reached.add(op)
        if not _tf_internals.is_function_call(op):
            try:
                if _tf_internals.gradient_function(op) is None:
                    continue  # no gradient flows through it
            except LookupError:
                return op
        stack.extend(t.op for t in op.inputs
                     if t.op in region and graph_lib.carries_gradient(t))
    return None


def _stop_list(stop_gradients) -> list:
    """``stop_gradients`` as a list of tensors (checked as :func:`gradients` checks it).
    None and an empty list stop nothing, as in ``tf.gradients``."""
    if stop_gradients is None or (isinstance(stop_gradients, (list, tuple)) and not stop_gradients):
        return []
    return _tensor_list(stop_gradients, "stop_gradients")


def _plan_of(checkpoints, problem, chosen, memory_budget, batch_size, stops=(),
             other_backward: tuple | None = None) -> planning.Plan:
    """The :class:`Plan` of ``chosen`` (and ``stop_gradients=stops``); its figures are
    remembered with the checkpoints (:mod:`.memo`), so that a retrace predicts nothing
    again."""
    strategy = checkpoints if isinstance(checkpoints, str) else "list"
    unknown = _unknown_sizes(problem.region)
    stated = batch_size is not None
    batch_size, batch_note = _batch_of_plan(checkpoints, problem, memory_budget, batch_size, unknown)
    schedule = schedule_lib.backward_schedule(
        problem.region, problem.ys, problem.xs, chosen, stops) if chosen else None

    def make():
        return planning.make_plan(
            problem.ys, problem.xs, problem.region, chosen, strategy,
            _unknown_dim(batch_size), onednn_enabled(), gpu_visible(),
            batch_known=not unknown, batch_note=batch_note, stops=stops, schedule=schedule,
            batch_stated=stated,
        )

    key = _memo_key(checkpoints, memory_budget, _planning_dim(batch_size, unknown),
                    problem.region, problem.ys, problem.xs)
    if key is None:
        made = make()
    else:
        made = memo.remembered_plan(key + _stops_key(stops, problem.region) + (stated,), chosen,
                                    make, schedule)
    # not remembered with the plan: it depends on the graph around the region
    note = _other_backward_note(problem) if other_backward is None else other_backward
    if made.batch is not None and not stated and isinstance(checkpoints, str):
        note += _above_plain_note(made)
    return dataclasses.replace(made, assumptions=made.assumptions + note) if note else made


def _above_plain_note(made: planning.Plan) -> tuple:
    """A note where a plan chosen for every batch peaks above plain at the batch its
    figures are given at: the largest batches decided the choice."""
    if (made.in_step_peak_bytes <= 1.05 * made.in_step_baseline_peak_bytes
            and made.predicted_peak_bytes <= 1.05 * made.baseline_peak_bytes):
        return ()
    return (f"at batch {made.batch} this plan peaks above plain tf.gradients: its checkpoints "
            "are chosen for the least worst-case peak over every batch, which the largest "
            "decide; pass batch_size= with the batch you feed to plan for that one",)


def _stops_key(stops, region) -> tuple:
    """What of ``stop_gradients`` a plan's figures depend on: the places in the region
    of the stops it produces (those outside it change no step); ``()`` for none."""
    inside = [t for t in stops if t.op in region]
    if not inside:
        return ()
    position = {op: i for i, op in enumerate(region.order)}
    return (tuple(sorted({(position[t.op], t.value_index) for t in inside})),)


def _batch_of_plan(checkpoints, problem, memory_budget, batch_size, unknown) -> tuple:
    """``(batch_size, notes)``: the batch a plan's figures are given at, and what its
    assumptions say about how the batch was chosen when it is unknown."""
    region = problem.region
    if not unknown:
        return batch_size, ()
    if batch_size is not None:  # batch_size= sets every unknown dimension: say so
        return batch_size, _beyond_batch_note(region)
    subject, unit = _what_is_unknown(region)
    notes = _batch_notes(checkpoints, problem, memory_budget, unknown, subject, unit)
    if unit == "batch":
        return notes[0], notes[1] + _beyond_batch_note(region)
    return notes


def _what_is_unknown(region) -> tuple:
    """``(subject, unit)`` for the notes of a region with unknown sizes: an unknown
    batch, or a known one beside other unknown sizes, fed or made in the graph."""
    if graph_lib.batch_is_unknown(region):
        return "the batch is unknown", "batch"
    fed = graph_lib.first_unknown(region, fed_only=True)
    if fed is not None:
        subject = (f"a tensor fed has an unknown dimension besides its first (e.g. {fed.name} "
                   f"{fed.shape}: a sequence length, or a batch that is not first)")
    else:
        made = graph_lib.first_unknown(region)
        subject = (f"no tensor fed to the differentiated ops has an unknown size, but sizes "
                   f"made in the graph are unknown (e.g. {made.name} {made.shape}: a loop's "
                   "length, or a batch fed to ops before them)")
    return (f"{subject}; every unknown dimension is counted as one size, which batch_size= "
            "sets"), "size"


def _beyond_batch_note(region) -> tuple:
    """Notes where dimensions other than the batch are unknown: they are counted as the
    batch is, so ``batch_size=`` sets them too.  Among them, the first dimensions of
    tensors fed whose row counts nothing ties to the others' (:mod:`.size_ties`)."""
    notes = ()
    beyond = graph_lib.unknown_beyond_batch(region)
    if beyond is not None:
        notes += (f"dimensions besides the batch are unknown too (e.g. {beyond.name} "
                  f"{beyond.shape}): every unknown dimension is counted as the same size, and "
                  "batch_size= sets them all; to plan at the length you feed, trace the step "
                  "with it known (an input_signature of tf.TensorSpec([None, length]), or "
                  "batches padded to it)",)
    untied = size_ties.untied_group(region)
    if untied:
        notes += (_untied_note(*untied),)
    return notes


def _untied_note(group: list, rest: list) -> str:
    """What :func:`size_ties.untied_group` found, and what to do about it."""
    return (f"the unknown first dimension of {_named_tensors(group)} is tied by no op "
            f"to that of {_named_tensors(rest)}, so the two may be fed different counts "
            "(a graph's edges and its nodes): the plan counts both as one size, which "
            "batch_size= sets, and its figures are off by the ratio of the counts you "
            "feed; to plan at those, trace the step with them known (an input_signature "
            "with the counts, or inputs padded to fixed counts)")


def _named_tensors(tensors) -> str:
    """``"e:0 (None, 2)"``, or ``"x:0 (None, 8) and 2 more"``."""
    first = f"{tensors[0].name} {tensors[0].shape}"
    return first if len(tensors) == 1 else f"{first} and {len(tensors) - 1} more"


def _batch_notes(checkpoints, problem, memory_budget, unknown, subject, unit) -> tuple:
    """``(batch_size, notes)`` for a strategy on a graph with unknown dimensions;
    ``subject`` says what is unknown, ``unit`` what its sizes are called."""
    if memory_budget is not None and isinstance(checkpoints, str):
        batch_size, _ = budget_batch(problem.ys, problem.xs, problem.region, memory_budget, unknown)
        return batch_size, (f"{subject}: planned at {unit} {batch_size}, the largest "
                            "at which memory_budget can be met (pass batch_size= to plan for "
                            "another)",)
    if checkpoints == "memory":
        return None, (f"{subject}: the checkpoints are chosen for every {unit} "
                      f"(the least worst-case peak at {unit}{'es' if unit == 'batch' else 's'} "
                      f"{batch_lib.describe_range()}); the peaks above are at "
                      f"{DEFAULT_BATCH_SIZE}; plan.peak_at(batch) gives any other",)
    if checkpoints == "balanced":
        return None, (f"{subject}: the trade is made at {unit} "
                      f"{batch_lib.PLANNING_BATCHES[-1]}; the peaks above are at "
                      f"{DEFAULT_BATCH_SIZE}; plan.peak_at(batch) gives any other",)
    return None, ()


def _memo_key(checkpoints, memory_budget, planning_dim, region, ys, xs):
    """What a strategy's plan is remembered by, or None where it is not (lists,
    the collection, which can change, and empty regions)."""
    if not isinstance(checkpoints, str) or checkpoints == "collection" or not region.ops:
        return None
    return (checkpoints, memory_budget, planning_dim, _fingerprint(region, ys, xs))


def _fingerprint(region, ys, xs) -> str:
    """:func:`.memo.fingerprint` with what the memory model makes of the region's
    inputs from outside it (a plan's sizes depend on them)."""
    return memo.fingerprint(region, ys, xs, simulate.outside_estimates(region))


#: Parameters of :func:`gradients` that are not options of an entry point.
_NOT_OPTIONS = ("ys", "xs", "grad_ys", "checkpoints")


def check_arguments(checkpoints: Checkpoints, options: dict, passed_by_caller: Sequence[str] = ()) -> None:
    """Raise what :func:`gradients` would for this strategy and these options.

    Every entry point that calls :func:`gradients` later (``patch()``,
    ``patched()``, ``keras.enable``, ``GradientTape``) calls this when it is
    called, so that a misspelled strategy or option, or a bad value, raises
    there; :func:`gradients` itself calls it first.  ``passed_by_caller``:
    parameters the entry point passes itself, so not options there.
    """
    for option in options:
        if option in _NOT_OPTIONS or option in passed_by_caller:
            raise TypeError(
                f"{option}= is not an option here: it is given when the gradients are "
                f"computed. Options are {_option_names(passed_by_caller)}."
            )
    try:
        _GRADIENTS_SIGNATURE.bind_partial(**options)
    except TypeError as error:
        raise TypeError(
            f"gradients() {error}. Options are {_option_names(passed_by_caller)}."
        ) from None
    if isinstance(checkpoints, str):
        strategies.get(checkpoints)
    else:
        _checkpoint_list(checkpoints)
    _check_option_values(checkpoints, options.get("memory_budget"), options.get("batch_size"))
    _check_gradient_options(options)


#: ``aggregation_method`` values ``tf.gradients`` accepts (``tf.AggregationMethod``).
_AGGREGATION_METHODS = {
    tf.AggregationMethod.ADD_N: "tf.AggregationMethod.ADD_N (the default)",
    tf.AggregationMethod.EXPERIMENTAL_TREE: "tf.AggregationMethod.EXPERIMENTAL_TREE",
    tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N: "tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N",
}


def _check_gradient_options(options: dict) -> None:
    """Raise what ``tf.gradients`` would for ``aggregation_method`` (a value equal to
    one of ``tf.AggregationMethod``'s) and ``unconnected_gradients``, before anything
    is built (TensorFlow raises midway, and only where gradients are aggregated)."""
    method = options.get("aggregation_method")
    if method is not None and method not in list(_AGGREGATION_METHODS):  # as tf.gradients
        raise ValueError(
            f"aggregation_method must be None or one of {list(_AGGREGATION_METHODS.values())} "
            f"({sorted(_AGGREGATION_METHODS)}); got {method!r}.")
    unconnected = options.get("unconnected_gradients")
    if unconnected is not None:
        try:
            tf.UnconnectedGradients(unconnected)
        except ValueError:
            raise ValueError(
                "unconnected_gradients must be tf.UnconnectedGradients.NONE or .ZERO (or "
                f"'none' / 'zero'); got {unconnected!r}.") from None


def _option_names(passed_by_caller) -> list:
    return [
        name for name in _GRADIENTS_SIGNATURE.parameters
        if name not in _NOT_OPTIONS and name not in passed_by_caller
    ]


def _check_option_values(checkpoints, memory_budget, batch_size) -> None:
    """TypeError for a ``batch_size`` or ``memory_budget`` that is no number of the
    kind, ValueError for one out of range (and a budget with a strategy that takes none)."""
    if batch_size is not None:
        wrong_type = isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
        if wrong_type or batch_size < 1:
            raise (TypeError if wrong_type else ValueError)(
                f"batch_size must be a positive integer; got {batch_size!r}.")
    if memory_budget is not None:
        if checkpoints != "memory":
            raise ValueError(
                f"memory_budget is used with checkpoints='memory', not {checkpoints!r}."
            )
        wrong_type = isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Real)
        if wrong_type or not 0 < memory_budget < float("inf"):
            raise (TypeError if wrong_type else ValueError)(
                f"memory_budget must be a positive, finite number of bytes; got "
                f"{memory_budget!r} (e.g. memory_budget=20 * 2**20 for 20 MiB, which the "
                "library's figures call 20 MB)."
            )


_warned_workspaces = False


#: The strategies whose checkpoints the caller chose: a list, or the ``'checkpoints'``
#: collection.
_CHOSEN_BY_THE_CALLER = frozenset({"list", "collection"})
#: The least recomputation (of a forward pass) that a list saving nothing is said for.
LEAST_RECOMPUTATION_SAID = 0.05


def _warn_if_list_raises_the_peak(made_plan) -> None:
    """A WARNING where checkpoints the caller chose (a list, the collection) are predicted
    to raise the peak of a training step above plain ``tf.gradients``' (the peak the
    strategies judge; they never keep such a plan), or to save nothing while they
    recompute.  Said where the plan is seen (a patch's record, INFO logging)."""
    if made_plan.strategy not in _CHOSEN_BY_THE_CALLER:
        return
    in_step = made_plan.in_step_ratio or made_plan.predicted_ratio
    if in_step <= 1 + strategies.LEAST_PEAK_TOLERANCE:
        _warn_if_list_saves_nothing(made_plan, in_step)
        return
    at, by_size = "", ""
    if made_plan.depends_on_batch and not made_plan.batch_stated:
        # the figures are at a stand-in for the unknown sizes: say so, and at which of
        # the sizes planned for the list raises the peak
        by_batch = made_plan.ratios_by_batch(in_step=True)
        if all(ratio <= 1 + strategies.LEAST_PEAK_TOLERANCE for _, ratio in by_batch):
            return
        at = (f" at size {made_plan.batch}, which stands in for the unknown dimensions "
              "(pass batch_size= with the size you feed)")
        by_size = " In a step, by size: " + ", ".join(
            f"{b}: {r:.2f}x" for b, r in by_batch) + "."
    logger.warning(
        "the %d checkpoints given are predicted to raise the peak of a training step "
        "that applies each gradient as it is made above plain tf.gradients'%s: %.2fx "
        "(%.2fx with every gradient held to the end, as session.run(grads) holds "
        "them), as what they hold outweighs what they let go; checkpoints='memory' "
        "searches for a plan that saves.%s",
        len(made_plan.checkpoints), at, in_step, made_plan.predicted_ratio, by_size)


def _warn_if_list_saves_nothing(made_plan, in_step: float) -> None:
    """A WARNING where checkpoints the caller chose are predicted to lower the peak of a
    training step by less than :data:`.strategies.LEAST_PEAK_TOLERANCE` (at every size
    planned, where sizes are unknown) while the backward pass recomputes (a helper's
    trial: a collection planned at plain's very peak, recomputing 324 ops at a predicted
    1.35x step time, was rewritten with nothing said)."""
    least = 1 - strategies.LEAST_PEAK_TOLERANCE
    if in_step < least or made_plan.recompute_cost < LEAST_RECOMPUTATION_SAID:
        return
    at = ""
    if made_plan.depends_on_batch and not made_plan.batch_stated:
        if any(ratio < least for _, ratio in made_plan.ratios_by_batch(in_step=True)):
            return
        at = " at every size planned for the unknown dimensions"
    logger.warning(
        "the %d checkpoints given are predicted to save nothing (less than %d%%) in a "
        "training step that applies each gradient as it is made%s: %.2fx plain "
        "tf.gradients' peak (%.2fx with every gradient held to the end), while the "
        "backward pass recomputes %.2f of a forward pass (predicted step time %.2fx); "
        "checkpoints='memory' searches for a plan that saves.",
        len(made_plan.checkpoints), round(100 * strategies.LEAST_PEAK_TOLERANCE), at,
        in_step, made_plan.predicted_ratio, made_plan.recompute_cost,
        made_plan.predicted_step_ratio)


def _warn_unmodelled_workspaces(region) -> None:
    """Once per process: what the model leaves out and can outweigh what checkpointing
    saves (convolution gradients' workspaces without oneDNN or in float16 on CPU, the
    buffers of functions XLA compiles): :func:`simulate.workspace_note`."""
    global _warned_workspaces
    if _warned_workspaces:
        return
    note = simulate.workspace_note(region, onednn_enabled(), gpu_visible())
    if note:
        _warned_workspaces = True
        for line in note:
            logger.warning("%s.", line)


_warned_outer: "weakref.WeakSet[tf.Graph]" = weakref.WeakSet()


def _outer_differentiator(problem) -> str | None:
    """What differentiates this gradient computation itself, where the rewrite cannot
    serve it, or None: a ``tf.autodiff.ForwardAccumulator``, which computes tangents as
    ops are made and never sees the rewrite's copies (made by :mod:`.rewrite`): forward
    over reverse came out wrong by 30-200%.  A recording ``tf.GradientTape`` is served:
    :func:`_record_for_outer_tapes` records the rewritten computation on it."""
    by_tape, by_accumulator = _tf_internals.recorded_by_an_outer_differentiator(
        list(problem.ys) + list(problem.xs))
    if by_accumulator:
        return ("a tf.autodiff.ForwardAccumulator (forward over reverse: it cannot see "
                "the recomputed ops)")
    outside = _made_outside_the_recording(problem.region) if by_tape else None
    if outside is not None:
        return (f"a tf.GradientTape that did not record all of this forward pass (e.g. "
                f"{outside.name}, made before its with block or under stop_recording: a "
                "constant to it, which the recomputed ops would make again)")
    return None


def _made_outside_the_recording(region) -> tf.Operation | None:
    """An op of ``region`` that reads a tensor a recording tape holds but whose output
    it does not hold (made before the tape's ``with`` block, or under
    ``stop_recording()``), or None.  To the tape its output is a constant; the rewrite's
    copies would make it again from what the tape holds, and the operation recorded for
    the rewrite would differentiate through it."""
    for op in region.order:
        if _rewrite_holding(op) is not None:
            continue  # the library's (a tape holds an earlier rewrite as one operation)
        if not _tf_internals.is_function_call(op) and _has_no_gradient(op):
            continue  # a tape records no op without a gradient (tf.stop_gradient, round)
        outputs = [t for t in op.outputs if graph_lib.carries_gradient(t)]
        if outputs and not _held_by_a_tape(outputs[0]) and any(
                graph_lib.carries_gradient(t) and _held_by_a_tape(t) for t in op.inputs):
            return op
    return None


def _held_by_a_tape(tensor: tf.Tensor) -> bool:
    """Whether a recording ``tf.GradientTape`` holds ``tensor`` (recorded its op, or watches it)."""
    return _tf_internals.recorded_by_an_outer_differentiator([tensor])[0]


def _has_no_gradient(op: tf.Operation) -> bool:
    try:
        return _tf_internals.gradient_function(op) is None
    except LookupError:  # none registered: gradients() finds it before this is asked
        return True


def _plain_for_tapes(graph: tf.Graph, ys, xs, grad_ys, options: dict) -> list:
    """Plain ``tf.gradients``, recorded on a recording tape as one operation where an
    earlier rewrite is part of what it differentiates (its ops would read copies no tape
    recorded): :func:`_record_for_outer_tapes`."""
    first = graph_lib.last_op_id(graph) + 1
    results = tf_gradients(ys, xs, grad_ys, **options)
    if _rewrites.get(graph) and graph_lib.last_op_id(graph) >= first:
        _remember_rewrite(graph, first, results)
        _record_for_outer_tapes(graph, first, results)
    return results


def _record_for_outer_tapes(graph: tf.Graph, first: int, results: list) -> None:
    """Where a ``tf.GradientTape`` is recording what the ops made since op id ``first``
    read (a gradient penalty's outer tape, a Hessian's), record their computation on it
    as one operation from :func:`_tape_frontier` to ``results``.  A tape records the ops
    it sees made, not the rewrite's copies (made below that API): differentiated by
    TensorFlow's tape, they gave second derivatives wrong by 30-200%, or None.  The
    recorded operation's gradient is ``tf.gradients`` through the graph's ops, copies
    included, and is itself recorded so, for a tape outside that one (third order)."""
    if not _tf_internals.could_record():
        return
    # a result made before (a y's grad_y, as the gradient of that y as an x) is known
    outputs = [t for t in _dense_tensors(results) if graph_lib.op_order(t.op) >= first]
    inputs, constants = _tape_frontier(graph, first)
    if not outputs or not inputs:
        return

    def backward(*output_gradients):
        grad_ys = [tf.zeros_like(t) if g is None else g for t, g in zip(outputs, output_gradients)]
        start = graph_lib.last_op_id(graph) + 1
        # partial derivatives: the tape goes on from each input through its own records;
        # what it never recorded is a constant to it
        grads = tf_gradients(outputs, inputs, grad_ys=grad_ys,
                             stop_gradients=inputs + constants)
        if graph_lib.last_op_id(graph) >= start:  # its ops read the copies: the same again
            _remember_rewrite(graph, start, grads)
            _record_for_outer_tapes(graph, start, grads)
        return grads

    _tf_internals.record_for_tapes("MemorySavingGradients", outputs, inputs, backward)


# per graph, the computations whose ops read recomputed copies (rewrites, and the
# gradients of their recorded operations): (first op id, last op id, their results)
_rewrites: "weakref.WeakKeyDictionary[tf.Graph, list]" = weakref.WeakKeyDictionary()


def _remember_rewrite(graph: tf.Graph, first: int, results: list) -> None:
    """Remember the ops made since op id ``first`` as a computation that reads copies no
    tape recorded, with its ``results`` (for :func:`_tape_frontier`)."""
    _rewrites.setdefault(graph, []).append(
        (first, graph_lib.last_op_id(graph), _dense_tensors(results)))


def _rewrite_holding(op: tf.Operation) -> int | None:
    """Index in ``_rewrites[op.graph]`` of the library's computation that made ``op``, or None."""
    order = graph_lib.op_order(op)
    for index, (low, high, _) in enumerate(_rewrites.get(op.graph, ())):
        if low <= order <= high:
            return index
    return None


def _dense_tensors(results: list) -> list:
    tensors = [g.values if isinstance(g, tf.IndexedSlices) else g for g in results]
    return [t for t in tensors if isinstance(t, tf.Tensor)]


def _tape_frontier(graph: tf.Graph, first: int) -> tuple:
    """``(inputs, constants)`` of the computation the ops made since op id ``first`` do,
    as a recording tape sees it.  Walking back from what they read: the ops this library
    built (the copies, and the gradients that read them, whose records lead to copies no
    tape holds) are walked through, here and in earlier rewrites whose results a tape
    holds (recorded as one operation each), where the tape holds what a copy stands for
    (its original op); a tensor made elsewhere that the tape holds (it recorded its op,
    or watches it) is an input, from which the tape goes on; anything else (made before
    the tape, under ``stop_recording``, or a copy of such an op) is a constant to the
    tape, as it would be without the rewrite."""
    rewrites = _rewrites.get(graph, ())
    held: dict = {}  # index in rewrites -> whether a recording tape holds its results

    def built_here(op) -> bool:
        if graph_lib.op_order(op) >= first:
            return True
        index = _rewrite_holding(op)
        if index is None:
            return False
        if index not in held:
            held[index] = _tf_internals.recorded_by_an_outer_differentiator(rewrites[index][2])[0]
        return held[index]

    def stands_for_a_held_op(t) -> bool:
        original = rewrite.original_of(t.op)
        return original is None or _held_by_a_tape(original.outputs[t.value_index])

    stack = []
    for op in reversed(graph.get_operations()):  # creation order: the newest last
        if graph_lib.op_order(op) < first:
            break
        stack.append(op)
    seen, inputs, constants = set(stack), {}, {}
    while stack:
        for t in stack.pop().inputs:
            if t.op in seen or t.ref() in inputs or t.ref() in constants:
                continue
            differentiable = graph_lib.carries_gradient(t) or t.dtype in (tf.resource, tf.variant)
            if built_here(t.op) and stands_for_a_held_op(t):
                # (the tape may hold some of these ops, made the usual way, but their
                # records lead to copies it does not hold)
                seen.add(t.op)
                stack.append(t.op)
            elif differentiable and not built_here(t.op) and _held_by_a_tape(t):
                inputs[t.ref()] = t
            elif differentiable:
                constants[t.ref()] = t
    return list(inputs.values()), list(constants.values())


def _say_outer_differentiator(problem, outer: str) -> None:
    """Once per graph, at WARNING: this gradient computation falls back to plain."""
    if problem.graph in _warned_outer:
        return
    _warned_outer.add(problem.graph)
    logger.warning(
        "%s differentiates this gradient computation: plain tf.gradients is used for this "
        "one (no memory saved for it).", outer)


_warned_untied_sizes: "weakref.WeakSet[tf.Graph]" = weakref.WeakSet()


def _warn_untied_sizes(problem) -> None:
    """Once per graph, at WARNING: tensors fed with unknown first dimensions that no op
    ties together (a graph's nodes and edges) are planned as one size
    (:mod:`.size_ties`); a GNN step was predicted at 0.39x of what it measured."""
    if problem.graph in _warned_untied_sizes or not _unknown_sizes(problem.region):
        return
    untied = size_ties.untied_group(problem.region)
    if untied:
        _warned_untied_sizes.add(problem.graph)
        logger.warning("The memory plan of %s may be far off: %s.",
                       _gradient_described(problem.ys, problem.xs),
                       _untied_note(*untied))


_warned_separate_terms: "weakref.WeakSet[tf.Graph]" = weakref.WeakSet()


def _warn_separate_terms(problem, batch_size) -> None:
    """Once per graph, at WARNING: ys sum terms from separate forward passes, whose
    backward passes TensorFlow may start while the others' forward passes run
    (:mod:`.terms`); on a WGAN-GP critic step every strategy measured above plain
    while its plan said 0.41x, and only an INFO line was logged."""
    if problem.graph in _warned_separate_terms:
        return
    found = terms.note(problem.region, problem.ys, problem.xs,
                       lambda t: graph_lib.tensor_bytes(t, _unknown_dim(batch_size)))
    if found:
        _warned_separate_terms.add(problem.graph)
        logger.warning("The memory plan of %s may be far off: %s.",
                       _gradient_described(problem.ys, problem.xs), found[0])


_warned_python_recomputed: "weakref.WeakSet[tf.Graph]" = weakref.WeakSet()


def _warn_python_recomputed(ops) -> None:
    """Once per graph, at WARNING: a ``tf.numpy_function(..., stateful=False)`` is
    recomputed, so its Python code runs again in the backward pass; one that draws
    random numbers then gives wrong gradients (a helper's trial: 24-143% off), which
    nothing else would say."""
    calls = [op for op in ops if op.type in op_types.STATELESS_PYTHON_FUNCTIONS]
    if not calls or calls[0].graph in _warned_python_recomputed:
        return
    _warned_python_recomputed.add(calls[0].graph)
    logger.warning(
        "%s (a tf.numpy_function with stateful=False) is recomputed: its Python function "
        "runs again in the backward pass and must return the same values for the same "
        "inputs; if it draws random numbers the gradients are wrong. Declare it "
        "stateful=True to keep its output instead.", calls[0].name)


_warned_other_backward: "weakref.WeakSet[tf.Graph]" = weakref.WeakSet()
_warned_concurrent_backward: "weakref.WeakSet[tf.Graph]" = weakref.WeakSet()


def _warn_other_backward(graph: tf.Graph, note: tuple) -> None:
    """Once per graph, the ``note`` of :func:`_other_backward_note`: a rewrite whose forward
    pass another backward pass also reads (a GAN's two tapes) is planned without it, and
    was measured to save nothing there; one beside another micro-batch's is planned alone."""
    same_forward = bool(note) and note[0].startswith(simulate.SAME_FORWARD_NOTE)
    warned = _warned_other_backward if same_forward else _warned_concurrent_backward
    if note and graph not in warned:
        warned.add(graph)
        logger.warning("%s. %s: measure the step (peak_memory_during).", note[0],
                       "On a small GAN, checkpointing either tape or both measured within "
                       "the step's run-to-run spread of plain" if same_forward else
                       "Four micro-batches' tapes of a small conv net measured 28 MiB "
                       "against 16.2 planned for each")


@dataclasses.dataclass(frozen=True)
class _Problem:
    graph: tf.Graph
    ys: list
    xs: list
    region: graph_lib.ForwardRegion
    stops: list


def _prepare(ys, xs, stop_gradients=None) -> _Problem:
    """Checked ys, xs and ``stop_gradients`` (as graph tensors) and the forward region
    between xs and ys: the ops a gradient passes through, not those it reaches only
    through a stop."""
    ys_list = _tensor_list(_numbers_as_constants(_as_list(ys), _as_list(xs)), "ys")
    graph = ys_list[0].graph
    with graph.as_default():
        xs_tensors = _x_tensors(_as_list(xs), graph)
        _check_same_graph(ys_list + xs_tensors, graph, "ys and xs", ys_list)
        stops = _stop_list(stop_gradients)
        _check_same_graph(stops, graph, "stop_gradients", ys_list)
        region = graph_lib.forward_region(ys_list, xs_tensors, stops)
    return _Problem(graph, ys_list, xs_tensors, region, stops)


_GRADIENTS_SIGNATURE = inspect.signature(gradients)


def _no_checkpoints_argument(function: str, kwargs: dict) -> None:
    if "checkpoints" in kwargs:
        raise TypeError(
            f"{function}() chooses its checkpoints itself; got checkpoints="
            f"{kwargs['checkpoints']!r}. Call memory_saving_gradients.gradients(..., "
            "checkpoints=...) to choose them."
        )


#: What the strategy entry points take (and ``help()`` shows): gradients()' parameters
#: but ``checkpoints``, so tf.compat.v1.gradients' in its order, then the library's
#: (by keyword only).
_STRATEGY_ENTRY_SIGNATURE = inspect.signature(gradients).replace(parameters=[
    p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.name in ("memory_budget", "batch_size")
    else p for p in inspect.signature(gradients).parameters.values() if p.name != "checkpoints"])


def _strategy_entry(strategy: str, entry_name: str, summary: str) -> Callable[..., list]:
    """``gradients`` with ``checkpoints=strategy``, taking ``tf.compat.v1.gradients``'
    arguments in its order, so that it can stand in for ``tf.gradients`` itself."""

    def entry(*args: Any, **kwargs: Any) -> list:
        _no_checkpoints_argument(entry_name, kwargs)
        try:
            bound = _STRATEGY_ENTRY_SIGNATURE.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{entry_name}(): {error}") from None
        return gradients(checkpoints=strategy, **bound.arguments)

    entry.__name__ = entry.__qualname__ = entry_name
    entry.__signature__ = _STRATEGY_ENTRY_SIGNATURE
    entry.__doc__ = (
        f"{summary}\n\n``gradients(..., checkpoints={strategy!r})`` with the arguments of "
        "``tf.compat.v1.gradients``, in its order (so that it can replace ``tf.gradients``; "
        "``memory_budget=`` and ``batch_size=`` by keyword).")
    return entry


gradients_collection = _strategy_entry(
    "collection", "gradients_collection", "``gradients`` with the tensors of the collection ``'checkpoints'``.")
gradients_memory = _strategy_entry(
    "memory", "gradients_memory", "``gradients`` with ``checkpoints='memory'``: bottlenecks chosen for the least peak.")
gradients_speed = _strategy_entry(
    "speed", "gradients_speed", "``gradients`` with ``checkpoints='speed'``: keep convolution and matmul outputs.")


def choose_checkpoints(
    checkpoints: Checkpoints,
    ys: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    region: graph_lib.ForwardRegion,
    graph: tf.Graph,
    memory_budget: float | None = None,
    batch_size: int | None = None,
    stops: Sequence[tf.Tensor] = (),
) -> list[tf.Tensor] | None:
    """Checked, usable checkpoint tensors, or None to fall back to ``tf.gradients``.

    Drops xs, ys and tensors not between them.  An explicit list that keeps
    nothing is an error; a strategy (or the collection) that finds nothing
    warns (``NothingKeptWarning``) why and falls back.  Strategies plan once per
    graph structure (:mod:`.memo`).  ``stops``: the ``stop_gradients`` the region
    was cut at (messages name them only where there are some).
    """
    _check_option_values(checkpoints, memory_budget, batch_size)
    if not any(graph_lib.carries_gradient(x) for x in xs):
        # no gradient reaches any x: a rewrite would build a backward pass for nothing
        # (the strategy or list was checked by check_arguments, as every caller does first)
        what = (f"checkpoints={checkpoints!r}" if isinstance(checkpoints, str)
                else "checkpoints (a list)")
        notices.warn(
            f"{what} keeps nothing: no x can carry a gradient (dtype {xs[0].dtype.name}: "
            "integers or booleans), so tf.gradients gives None for every x. Using plain "
            "tf.gradients (no memory is saved).", notices.NothingKeptWarning)
        return None
    if isinstance(checkpoints, str):
        strategy = strategies.get(checkpoints)
        unknown = _unknown_sizes(region)
        fitting = None  # with a budget and an unknown batch: the plan its batch was found with
        stated = batch_size is not None
        if memory_budget is not None and unknown and batch_size is None:
            batch_size, fitting = budget_batch(ys, xs, region, memory_budget, unknown)
            _say_budget_batch(graph, memory_budget, batch_size)
        options = {"unknown_dim": _planning_dim(batch_size, unknown)}
        if memory_budget is not None:
            options["memory_budget"] = memory_budget

        planned_now = False  # else remembered: its NothingKeptWarning came the first time

        def choose():
            nonlocal planned_now
            planned_now = True
            try:
                found = strategy(ys, xs, region, **options)
            except ValueError:
                if fitting is None:
                    raise
                found = fitting  # it fits at that batch, by the same memory model
            usable = usable_checkpoints(found, ys, xs, region)
            if not usable:
                _warn_nothing_kept(checkpoints, ys, xs, region, options["unknown_dim"], unknown,
                                   memory_budget, stated, bool(stops))
            elif checkpoints in _RULE_STRATEGIES:
                usable = _unless_nothing_saved(checkpoints, usable, ys, xs, region,
                                               options["unknown_dim"], unknown)
            return usable

        key = _memo_key(checkpoints, memory_budget, options["unknown_dim"], region, ys, xs)
        usable = choose() if key is None else memo.remembered(key, region, choose)
        if not usable and not planned_now:
            logger.info("checkpoints=%r keeps nothing on this graph, as planned before for "
                        "the same structure: plain tf.gradients.", checkpoints)
        return usable or None
    given = _checkpoint_list(checkpoints)
    nested = [t for t in given if graph_lib.in_function_body_of(t, graph)]
    if nested:
        logger.warning(
            "Ignoring %d checkpoint(s) inside the body of a tf.while_loop, tf.cond or "
            "function (%s): such constructs are kept whole, never split.",
            len(nested), [t.name for t in nested][:5],
        )
    outer = [t for t in given if not graph_lib.in_function_body_of(t, graph)]
    _check_same_graph(outer, graph, "checkpoints", ys)
    no_path = _no_gradient_path(ys, region, bool(stops))
    if no_path:  # no op between xs and ys: plain tf.gradients, as a strategy would
        notices.warn(
            f"checkpoints (a list of {len(given)}) keeps nothing: {no_path}. Using plain "
            "tf.gradients (no memory is saved).",
            notices.NothingKeptWarning)
        return None
    usable = usable_checkpoints(outer, ys, xs, region)
    if not usable and usable_checkpoints(outer, ys, xs, graph_lib.forward_region(ys, xs)):
        notices.warn(
            f"checkpoints (a list of {len(given)}) keeps nothing: each lies where "
            "stop_gradients cuts the gradient off, where nothing is differentiated. Using "
            "plain tf.gradients (no memory is saved).", notices.NothingKeptWarning)
        return None
    if not usable:
        inside = (f" {len(nested)} of them lie inside the body of a tf.while_loop, tf.cond "
                  f"or function ({[t.name for t in nested][:5]}), which is kept whole, never "
                  "split: checkpoint tensors outside such constructs." if nested else "")
        raise ValueError(
            f"None of the {len(given)} checkpoints can be used: a checkpoint must be "
            "a tensor computed from xs on the way to ys, and neither an x nor a y "
            f"(got {[t.name for t in given][:10]}).{inside} Pass intermediate activations, "
            "or use checkpoints='memory'."
        )
    ends = {t.ref() for t in list(ys) + list(xs)}
    kept = {t.ref() for t in usable}
    aside = [t.name for t in outer if t.ref() not in kept and t.ref() not in ends]
    if aside:  # xs and ys in the list are dropped as documented; these are not on the way
        logger.warning(
            "Ignoring %d of the %d checkpoints: not on a path from xs to ys%s, so nothing "
            "there is recomputed: %s.",
            len(aside), len(given), " that stop_gradients leaves" if stops else "", aside[:5])
    return usable


def _unknown_dim(batch_size) -> int:
    return DEFAULT_BATCH_SIZE if batch_size is None else int(batch_size)


def _unknown_sizes(region) -> str:
    """:func:`.graph.has_unknown_dims` of ``region``, or ``""`` where the memory model
    bounds every unknown size by known ones (:func:`.simulate.counts_unknown_sizes`):
    the plan's figures then hold at any batch, and no batch is assumed."""
    unknown = graph_lib.has_unknown_dims(region)
    return unknown if unknown and simulate.counts_unknown_sizes(region) else ""


def _planning_dim(batch_size, unknown: str):
    """``unknown_dim`` for a strategy: the stated batch, or None (plan for every batch)
    where the graph has unknown dimensions and no batch is stated."""
    if batch_size is None and unknown:
        return None
    return _unknown_dim(batch_size)


_budget_batches: dict = {}  # (fingerprint, budget) -> batch


def budget_batch(ys: Sequence[tf.Tensor], xs: Sequence[tf.Tensor], region: graph_lib.ForwardRegion,
                 memory_budget: float, unknown: str) -> tuple[int, list[tf.Tensor]]:
    """``(batch, checkpoints)``: the largest batch at which ``memory_budget`` can be met,
    and the plan for every batch (``'memory'`` without a budget) that meets it there.

    Raises ValueError when not even a batch of one fits.
    """
    fingerprint = _fingerprint(region, ys, xs)
    any_batch = memo.remembered(
        ("memory", None, None, fingerprint), region,
        lambda: usable_checkpoints(strategies.any_batch_checkpoints(ys, xs, region),
                                   ys, xs, region))
    key = (fingerprint, float(memory_budget))
    if key not in _budget_batches:
        if len(_budget_batches) > memo.CAPACITY:
            _budget_batches.clear()
        model = batch_lib.PeakModel(region, ys, xs, any_batch)
        # no headroom: a budget is met as predicted, as with a stated batch (the
        # headroom is plan.largest_batch's, for the memory the user has)
        _budget_batches[key] = model.largest_batch(memory_budget, headroom=0.0)
    batch = _budget_batches[key]
    if batch < 1:
        least = batch_lib.PeakModel(region, ys, xs, any_batch).peak_at(1)
        subject, unit = _what_is_unknown(region)
        beyond = ()
        if unit == "batch":
            subject, beyond = "this graph's batch is unknown", _beyond_batch_note(region)
        raise ValueError(
            f"memory_budget={describe_bytes(memory_budget)} cannot be met at any batch size: "
            f"{subject} ({unknown}), and at {unit} 1 the least peak the "
            f"memory model finds is {describe_bytes(least)}. Raise the budget, or pass "
            "batch_size=N to plan for the size you feed."
            + "".join(f" ({note})" for note in beyond)
        )
    return batch, any_batch


_warned_budget_batches: "weakref.WeakKeyDictionary[tf.Graph, set]" = weakref.WeakKeyDictionary()


def _say_budget_batch(graph: tf.Graph, memory_budget: float, batch: int) -> None:
    """Once per graph and budget, at WARNING: with an unknown batch, a budget holds only
    up to the batch it was planned at; a step fed more peaks above it (with a stated
    batch, a budget that cannot be met raises)."""
    said = _warned_budget_batches.setdefault(graph, set())
    if memory_budget in said:
        return
    said.add(memory_budget)
    logger.warning(
        "memory_budget=%s with an unknown batch: the memory model meets it at batches up "
        "to %d, where the step is planned; a larger batch peaks above it. Pass batch_size= "
        "with the batch you feed to plan for that one (a budget that cannot be met there "
        "raises).", describe_bytes(memory_budget), batch)


#: Strategies that choose with the memory model (:mod:`.simulate`).
_MODELLED_STRATEGIES = ("memory", "balanced")


def _no_gradient_path(ys, region, stopped: bool) -> str:
    """Why no gradient can flow from ys to xs, or "" where one can (``stopped``: the
    region was cut at ``stop_gradients``)."""
    if not any(graph_lib.carries_gradient(y) for y in ys):
        return (f"no y can carry a gradient (dtype {ys[0].dtype.name}: an argmax, a cast to "
                "integers), so tf.gradients gives None for every x too")
    if not region.ops:
        return ("ys do not depend on xs through any op"
                + (" that stop_gradients leaves" if stopped else ""))
    return ""


def _warn_nothing_kept(checkpoints, ys, xs, region, unknown_dim, unknown,
                       memory_budget=None, stated=False, stopped=False) -> None:
    """One warning that says why a strategy keeps nothing (``stated``: the caller passed
    ``batch_size=``; ``stopped``: ``stop_gradients`` cut the region)."""
    plain_fits = memory_budget is not None and simulate.predict_baseline(
        region, ys, xs, unknown_dim, fetched=True).peak_bytes <= memory_budget
    no_path = _no_gradient_path(ys, region, stopped)
    if no_path:
        why = no_path
    elif checkpoints == "collection":
        why = (f"the collection {strategies.COLLECTION_NAME!r} holds no tensor between "
               "xs and ys (add activations with tf.compat.v1.add_to_collection)")
        others = [item for item in ys[0].graph.get_collection(strategies.COLLECTION_NAME)
                  if not isinstance(item, tf.Tensor)]
        if others:
            why += (f"; it holds {len(others)} entries that are not tensors, which are "
                    f"ignored (e.g. {_describe(others[0])})")
    elif checkpoints not in _MODELLED_STRATEGIES:
        what = ("the outputs of convolutions and matrix products and the tensors read by "
                "several ops" if checkpoints == "speed" else "its tensors")
        why = f"it keeps {what}, and none of them lies between xs and ys"
    elif plain_fits:
        why = (f"plain tf.gradients' predicted peak fits memory_budget="
               f"{describe_bytes(memory_budget)}, so nothing needs recomputing")
        if unknown:
            why += "".join(f" (but {note})" for note in _beyond_batch_note(region))
    else:
        any_batch = unknown_dim is None
        at = batch_lib.PLANNING_BATCHES[-1] if any_batch else unknown_dim
        unit = "batch" if graph_lib.batch_is_unknown(region) else "size"
        baseline = simulate.predict_baseline(region, ys, xs, at, fetched=False)
        at_batch = f" at {unit} {at}" if unknown and any_batch else ""
        lower = ("that lowers the peak by more than "
                 f"{strategies.LEAST_PEAK_TOLERANCE:.0%} at every {unit} it plans for, against"
                 if unknown and any_batch else
                 f"that lowers the peak by more than {strategies.LEAST_PEAK_TOLERANCE:.0%} below")
        why = (
            f"the memory model predicts no set of checkpoints {lower} "
            f"plain tf.gradients' {describe_bytes(baseline.peak_bytes)}{at_batch} (in a step "
            "that applies each gradient as it is made) on this graph "
            f"({len(region.ops)} ops between xs and ys; {_why_nothing_helps(region)})"
        )
        if unknown and any_batch:
            why += (f"; unknown dimensions ({unknown}) were planned for every {unit}, "
                    f"judged at {batch_lib.describe_range()} (the figure is at "
                    f"{at}): pass batch_size=N to plan for one {unit}")
        elif unknown and stated:
            why += f"; unknown dimensions ({unknown}) were counted as batch_size={unknown_dim}"
        elif unknown:
            why += (f"; unknown dimensions ({unknown}) were counted as {unknown_dim}: "
                    "pass batch_size=N if you feed a larger batch")
    notices.warn(
        f"checkpoints={checkpoints!r} keeps nothing for {_gradient_described(ys, xs)}: "
        f"{why}. Using plain tf.gradients (no memory is saved).",
        notices.NothingKeptWarning
    )


def _gradient_described(ys, xs) -> str:
    """Which gradient a message is about: ``"the gradient of 'loss:0' with respect to 4
    tensors in function 'step'"``, so that a step with several can tell them apart."""
    of = repr(ys[0].name) + (f" and {len(ys) - 1} more" if len(ys) > 1 else "")
    wrt = repr(xs[0].name) if len(xs) == 1 else f"{len(xs)} tensors"
    return f"the gradient of {of} with respect to {wrt} in {reporting.where(ys[0].graph)}"


#: Strategies that keep tensors by a rule, not by the memory model: they fall back to plain
#: tf.gradients where the model predicts their plan saves nothing.
_RULE_STRATEGIES = ("speed",)
#: The least saving (a fraction of plain tf.gradients' predicted peak) for which such a
#: plan is kept: a smaller one is within the memory model's error, and its
#: recomputation would cost time for it.
RULE_MIN_SAVING = 0.02


def _unless_nothing_saved(checkpoints, usable, ys, xs, region, unknown_dim, unknown="") -> list:
    """``usable``, or [] with a warning where the memory model predicts for it a peak less
    than :data:`RULE_MIN_SAVING` under plain tf.gradients' (recomputing would then cost
    time for nothing, or for a saving within the model's error).

    With an unknown batch the peaks are compared at the largest planning batch, where
    activations weigh most.
    """
    at = batch_lib.PLANNING_BATCHES[-1] if unknown_dim is None else unknown_dim
    peaks = batch_lib.PeakModel(region, ys, xs, usable)
    planned, plain = peaks.peak_at(at), peaks.peak_at(at, plain=True)
    if planned < (1 - RULE_MIN_SAVING) * plain:
        return usable
    where = f"unknown dimensions ({unknown}) counted as {at}; " if unknown else ""
    saves = ("saves nothing" if planned >= plain else
             f"saves only {1 - planned / plain:.1%} (less than the {RULE_MIN_SAVING:.0%} worth "
             "recomputing for)")
    notices.warn(
        f"checkpoints={checkpoints!r} {saves} on this graph: keeping its "
        f"{len(usable)} tensors, the memory model predicts a peak of {planned / MIB:.2f} MB "
        f"against plain tf.gradients' {plain / MIB:.2f} MB ({where}"
        f"{_why_speed_saves_nothing(region, usable)}). "
        "Using plain tf.gradients (no recomputation); "
        "checkpoints='memory' searches for a plan that does save.",
        notices.NothingKeptWarning
    )
    return []


def _why_speed_saves_nothing(region, kept) -> str:
    """Why keeping the expensive ops' outputs saves nothing: ops kept whole, or outputs that
    weigh what the activations recomputed from them do (named by the most kept op type)."""
    if any(op.type in graph_lib.CONTROL_FLOW_OP_TYPES for op in region.order):
        return _why_nothing_helps(region)
    most = collections.Counter(t.op.type for t in kept).most_common(1)
    example = f", e.g. a {most[0][0]}'s output in place of the activation after it" if most else ""
    return ("each kept output weighs as much as the activations it would be recomputed "
            f"into{example}")


def _why_nothing_helps(region) -> str:
    """Why no checkpoint lowers the peak: ops kept whole, or small activations."""
    whole = sorted({op.type for op in region.order if op.type in graph_lib.CONTROL_FLOW_OP_TYPES})
    if whole:
        count = sum(1 for op in region.order if op.type in graph_lib.CONTROL_FLOW_OP_TYPES)
        return (
            f"{count} of them are loops, conditionals or function calls ({', '.join(whole)}), "
            "which are kept whole, never split: what they hold for the backward pass "
            "stays as in plain tf.gradients"
        )
    custom = sum(1 for op in region.order if graph_lib.custom_gradient_arguments(op) is not None)
    if custom:
        return (
            f"{custom} of them are tf.custom_gradient functions (tf.recompute_grad blocks, "
            "Keras' quantized layers, silu), whose gradients read what their Python "
            "closures hold, and the activations left to recompute are small next to "
            "what the backward pass must hold anyway"
        )
    return "its activations are small next to what the backward pass must hold anyway"


def usable_checkpoints(candidates: Iterable[tf.Tensor], ys: Sequence[tf.Tensor],
                       xs: Sequence[tf.Tensor], region: graph_lib.ForwardRegion) -> list[tf.Tensor]:
    """Candidates between xs and ys that are neither, deduplicated, in topological order."""
    excluded = {t.ref() for t in list(ys) + list(xs)}
    usable: dict = {}
    for t in candidates:
        if t.ref() in excluded or not region.produces(t):
            logger.debug("checkpoint %s is not between xs and ys; ignored", t.name)
            continue
        usable.setdefault(t.ref(), t)
    return sorted(usable.values(), key=graph_lib.tensor_order)


@dataclasses.dataclass(frozen=True)
class _GradientOptions:
    """How TensorFlow's gradients are taken: the options of :func:`gradients` they pass on."""

    colocate_gradients_with_ops: bool
    gate_gradients: bool
    aggregation_method: object
    unconnected: tf.UnconnectedGradients

    def for_tf_gradients(self) -> dict:
        """The keyword arguments every ``tf.gradients`` call of the backward pass takes."""
        return dict(
            colocate_gradients_with_ops=self.colocate_gradients_with_ops,
            gate_gradients=self.gate_gradients,
            aggregation_method=self.aggregation_method,
        )


@dataclasses.dataclass(frozen=True)
class _Request:
    """One checkpointed backward pass: what :func:`gradients` was asked, checked."""

    ys: list
    xs: list
    grad_ys: list
    region: graph_lib.ForwardRegion
    checkpoints: list
    stops: list
    options: _GradientOptions
    unknown_dim: int = DEFAULT_BATCH_SIZE  # what the memory model counts an unknown dim as


def _guarded(backprop):
    """``backprop``, checked by :mod:`.guard`: where its gradients' structure differs
    from ``tf.gradients``' (or it fails inside), plain ``tf.gradients``' own, with a
    :class:`~.notices.FallbackWarning`."""

    @functools.wraps(backprop)
    def checked(request: _Request) -> list:
        options = request.options

        def plain():
            return tf_gradients(
                request.ys, request.xs, request.grad_ys, name="fallback",
                **options.for_tf_gradients(),
                stop_gradients=list(request.stops) or None,
                unconnected_gradients=options.unconnected,
            )

        return guard.guarded_gradients(
            lambda: backprop(request), plain, request.ys[0].graph, request.ys, request.xs,
            request.grad_ys, request.stops, options.unconnected,
        )

    return checked


@_guarded
def _backprop(request: _Request) -> list:
    """The gradients of ``request``: the steps of its backward schedule, built in order."""
    schedule = schedule_lib.backward_schedule(
        request.region, request.ys, request.xs, request.checkpoints, request.stops)
    _warn_if_recomputing_much(schedule, request.region)
    reporting.scheduled(schedule)
    backward = _BackwardPass(request, schedule)
    for step in schedule.steps:
        backward.take(step)
    backward.finish_gates()
    return backward.results()


#: Recomputed ops, as a multiple of the ops between xs and ys, above which a backward
#: pass is said to recompute much (one extra forward pass recomputes them once).
MANY_RECOMPUTED = 3


_warned_recomputing: "weakref.WeakSet[tf.Graph]" = weakref.WeakSet()


def _warn_if_recomputing_much(schedule: schedule_lib.Schedule, region) -> None:
    """Once per graph, a WARNING where the schedule copies more than
    :data:`MANY_RECOMPUTED` times the region's ops: kept tensors that do not separate the
    graph (a list of every n-th layer's output on Inception or NASNet cells) leave each
    segment to reach back past them, and segments overlap (NASNet: 169,607 copies, 742 s
    to build)."""
    copies = sum(len(step.segment.ops) for step in schedule.steps
                 if step.handling == schedule_lib.RECOMPUTED)
    graph = region.order[0].graph if region.order else None
    if copies > MANY_RECOMPUTED * max(1, len(region.ops)) and graph not in _warned_recomputing:
        if graph is not None:
            _warned_recomputing.add(graph)
        logger.warning(
            "these checkpoints make the backward pass recompute %d ops, %.1f times the %d "
            "between xs and ys: branches pass around the kept tensors, so each one's "
            "segment reaches back to tensors that separate the graph, and the segments "
            "overlap. Building it takes long and the step runs slower than one extra "
            "forward pass; checkpoints='memory' keeps tensors that separate the graph.",
            copies, copies / max(1, len(region.ops)), len(region.ops))


class _Contributions:
    """Gradient contributions to kept tensors, each tensor's summed once, when first read.

    ``open`` tensors (not xs: only the final sums read theirs) have contributions
    not summed yet: the gradients later steps will read.
    """

    def __init__(self, options: _GradientOptions, built_after: int):
        self._options = options
        self._built_after = built_after  # ops with larger ids are this pass's own
        self._parts: dict = {}  # ref -> contributions, in the order they came
        self._totals: dict = {}  # ref -> their sum (or None), once read
        self._open: dict = {}  # refs with contributions not summed yet, in order

    def add(self, tensor: tf.Tensor, gradient, still_read: bool = True) -> None:
        """One contribution to ``tensor``'s gradient; ``still_read``: a later step reads it."""
        if tensor.ref() in self._totals:
            raise AssertionError(f"gradient of {tensor.name} was summed before it was complete")
        self._parts.setdefault(tensor.ref(), []).append(gradient)
        if still_read:
            self._open.setdefault(tensor.ref(), True)

    def has(self, tensor: tf.Tensor) -> bool:
        return bool(self._parts.get(tensor.ref()))

    def total(self, tensor: tf.Tensor):
        """The sum of ``tensor``'s contributions (None without any); no more may come."""
        key = tensor.ref()
        if key not in self._totals:
            parts = self._parts.get(key)
            self._totals[key] = (
                rewrite.sum_gradients(
                    parts, tensor.op if self._options.colocate_gradients_with_ops else None,
                    self._options.aggregation_method, self._built_after,
                )
                if parts else None
            )
            self._open.pop(key, None)
        return self._totals[key]

    def pending(self) -> list:
        """The gradient tensors that steps not yet built will read as they are.

        A contribution summed with others is read later only by their sum, which
        follows a recomputation's wait only through a contribution made after that
        wait: no op built before reads that one, so common-subexpression elimination
        cannot merge one with the sum, and a sum (``AddN``, a concatenation, an
        ``IndexedSlices``' conversion) is no partner of a fusion of two readers of one
        value (a bias gradient with a filter gradient) (:class:`_ReadersOfPendingGradients`).
        Of a tensor with several
        contributions only an ``IndexedSlices``' dense shape counts: their
        concatenation passes it on as it is.  Contributions that may be zeros (filled
        or constant: grappler drops them from a sum, which may leave the other one
        read as it is) do not make a sum.
        """
        pending = []
        for key in self._open:
            parts = self._parts[key]
            summed = sum(1 for g in parts if not _may_be_zeros(g)) >= 2
            for g in parts:
                if not summed:
                    pending.extend(rewrite.tensors_of(g))
                elif isinstance(g, tf.IndexedSlices) and g.dense_shape is not None:
                    pending.append(g.dense_shape)
        return pending


def _may_be_zeros(gradient) -> bool:
    """Whether a dense gradient contribution may be all zeros (made by a fill or a constant)."""
    return isinstance(gradient, tf.Tensor) and gradient.op.type in op_types.MAY_BE_ZEROS


class _BackwardPass:
    """Builds the steps of a backward schedule in order, and the gradients of xs at the end.

    Ordering: every copy and every new gradient op of a step waits (control
    inputs) for the gradients flowing into its targets, and a recomputation also
    waits for the previous recomputed step's gradients, where that closes no cycle
    (:class:`_ReadersOfPendingGradients`).  Inside a step, a copy's input gradients
    wait for each other, or late where the memory model allows it
    (:class:`.rewrite.GradientGates`, :func:`.simulate.step_order`).
    """

    def __init__(self, request: _Request, schedule: schedule_lib.Schedule):
        self._request = request
        self._options = request.options
        self._schedule = schedule
        self._sums = _Contributions(request.options,
                                    graph_lib.last_op_id(request.ys[0].graph))
        self._x_keys = {x.ref() for x in request.xs}
        self._differentiated: set = set()  # the ops of the groups differentiated
        self._previous_results: list = []  # the ops of the last recomputed step's gradients
        graph = request.ys[0].graph
        self._readers = _ReadersOfPendingGradients(graph)
        # XLA drops control inputs: there, recomputed inputs also depend on the
        # incoming gradient through data (see rewrite.proxies).
        self._for_xla = graph_lib.builds_for_xla(graph)
        self._top_waits = self._seed_ys()
        self._gates = rewrite.GradientGates()
        # (step index, segment position) of each gated product that may wait late -> its
        # pair's; their copies, as the steps are built
        self._order = simulate.StepOrder() if self._for_xla else simulate.step_order(
            request.region, request.ys, request.xs, request.checkpoints, request.unknown_dim,
            request.stops, schedule)
        self._late = dict(self._order.late)
        self._paired = set(self._late) | set(self._late.values())
        self._copy_at: dict = {}  # those keys -> their copies, as the steps are built

    def _seed_ys(self) -> set:
        """Adds the gradients of ys (grad_ys, or ones); returns the ops a variable's proxy
        must not wait for.

        Where ys is not fetched, grappler reduces the forward ops above the last
        checkpoint to their ordering and moves a wait on ys (or on the ones of the
        default grad_ys, which wait for ys' shape) onto that checkpoint's op, whose only
        reader may then be a copy: a proxy beside that copy must not wait for them.
        """
        ys = self._request.ys
        top_waits = {y.op for y in ys}
        defaults = rewrite.default_grad_ys(
            self._request.grad_ys, ys, self._options.colocate_gradients_with_ops)
        for y, g in zip(ys, defaults):
            self._sums.add(y, g)
            top_waits.update(part.op for part in rewrite.tensors_of(g))
        return top_waits

    def take(self, step: schedule_lib.Step) -> None:
        """Builds one step, if a gradient reaches one of its targets."""
        targets = [t for t in step.targets if self._sums.has(t)]
        if not targets:
            return
        self._differentiated.update(step.group)
        target_grads = [self._sums.total(t) for t in targets]
        incoming = [part for g in target_grads for part in rewrite.tensors_of(g)]
        waits = [t.op for t in targets] + [part.op for part in incoming] + (
            self._readers.safe_to_wait_for(
                self._previous_results, incoming + self._sums.pending()))
        if not step.inputs:
            return  # no gradient of it reaches an x
        if step.handling == schedule_lib.RECOMPUTED:
            input_grads = self._recompute(step, targets, target_grads, waits)
        elif step.handling == schedule_lib.IN_PLACE:
            input_grads = self._in_place(step, targets, target_grads)
        else:
            input_grads = self._whole(step, targets, target_grads)
        self._collect(step.inputs, input_grads)

    def _recompute(self, step, targets, target_grads, waits) -> list:
        """Copies the step's segment (the copies wait for ``waits``) and differentiates them."""
        index = step.index
        stops = self._request.stops
        data_after = target_grads if self._for_xla else ()
        # variables' values do not wait for ys or their default grad_ys (see
        # _seed_ys): grappler may move those waits onto the last checkpoint
        variables = [t for t in step.trainable_inputs if graph_lib.reads_a_variable(t)]
        inputs = rewrite.proxies(
            [t for t in step.trainable_inputs if not graph_lib.reads_a_variable(t)],
            f"recompute_{index}/inputs", waits, data_after=data_after,
        )
        inputs.update(rewrite.proxies(
            variables, f"recompute_{index}/inputs",
            [op for op in waits if op not in self._top_waits], data_after=data_after,
        ))
        copies = rewrite.copy_ops(step.segment.ops, inputs, waits, f"recompute_{index}")
        # each copy's input gradients are released together (or, where the memory model
        # allows it, before its pair's are used), so that the executor frees the
        # recomputed tensors in the order simulated (XLA drops control inputs: nothing
        # to gate there)
        gated = () if self._for_xla else {t.op for t in copies.values()}
        late = set()
        for position, op in enumerate(step.segment.ops):
            if (index, position) in self._paired and op.outputs:
                copy = self._copy_at[index, position] = copies[op.outputs[0].ref()].op
                if (index, position) in self._late:
                    late.add(copy)
        made_after = graph_lib.last_op_id(copies[targets[0].ref()].graph)
        region = self._request.region
        running = graph_lib.copies_that_run(
            step.segment.ops, graph_lib.needs_gradient_in(region, self._x_keys),
            self._schedule.read_kept, region.receives_gradient)
        _warn_python_recomputed(running)
        try:
            with rewrite.closures_read_copies(copies, running), \
                    self._gates.recording(gated, late):
                input_grads = tf_gradients(
                    [copies[t.ref()] for t in targets],
                    [inputs[t.ref()] for t in step.inputs],
                    grad_ys=target_grads,
                    name=f"backprop_{index}",
                    **self._options.for_tf_gradients(),
                    stop_gradients=list(inputs.values()) + [copies.get(s.ref(), s) for s in stops],
                )
        except LookupError as error:
            raise _naming_original(error, step.segment.ops, copies) from error
        rewrite.read_kept_outputs(step.segment.ops, copies, running, self._schedule.read_kept,
                                  made_after)
        if not self._for_xla:
            self._order_early_gradients(index, input_grads, copies, made_after)
        # The next recomputation waits for all of this one's gradients: segments
        # whose gradients are ready together would otherwise recompute at the same time.
        self._previous_results = [
            part.op for g in input_grads if g is not None for part in rewrite.tensors_of(g)
        ] or self._previous_results
        return input_grads

    def _order_early_gradients(self, index, input_grads, copies, made_after) -> None:
        """The step's gradient ops that read nothing recomputed wait for its recomputation,
        as the memory model runs them, unless their outputs fit the model's headroom
        there (:class:`.simulate.StepOrder`): running early, they hold their buffers
        across it."""
        entries, sinks, early = graph_lib.early_gradient_ops(
            [part for g in input_grads if g is not None for part in rewrite.tensors_of(g)],
            {t.op for t in copies.values()}, made_after)
        if not entries:
            return
        held = sum(
            graph_lib.tensor_bytes(t, self._request.unknown_dim)
            for op in early if not graph_lib.shares_input_buffer(op) for t in op.outputs
        )
        if held > self._order.headroom.get(index, 0) + self._order.tolerance:
            rewrite.add_control_inputs(entries, sinks)

    def finish_gates(self) -> None:
        """Adds the late gates' waits, now that every step's gradients are built."""
        self._gates.finish({
            self._copy_at[key]: self._copy_at.get(pair)
            for key, pair in self._late.items() if key in self._copy_at
        })

    def _in_place(self, step, targets, target_grads) -> list:
        """Calls the registered gradient of the step's one op on the forward op."""
        op = step.op
        with tf.name_scope(f"backprop_{step.index}"):
            by_output = {t.ref(): g for t, g in zip(targets, target_grads)}
            return rewrite.op_gradients(
                op, [by_output.get(t.ref()) for t in op.outputs],
                self._options.gate_gradients, self._options.colocate_gradients_with_ops,
            )

    def _whole(self, step, targets, target_grads) -> list:
        """``tf.gradients`` from the targets to the step's inputs, through the forward ops."""
        return tf_gradients(
            targets,
            list(step.inputs),
            grad_ys=target_grads,
            name=f"backprop_{step.index}",
            **self._options.for_tf_gradients(),
            stop_gradients=list(step.segment.inputs) + list(self._request.stops),
        )

    def _collect(self, inputs, input_grads) -> None:
        """Adds the gradients of kept inputs through which a gradient reaches an x."""
        kept, carriers = self._schedule.kept, self._schedule.carriers
        for t, g in zip(inputs, input_grads):
            if g is not None and t.ref() in kept and t.ref() in carriers:
                self._sums.add(t, g, still_read=t.ref() not in self._x_keys)

    def results(self) -> list:
        """One gradient per x, as ``tf.gradients`` gives it."""
        xs, region = self._request.xs, self._request.region
        results = []
        reach = None
        for x in xs:
            g = self._sums.total(x)
            if g is None and x.op in self._differentiated:
                # tf.gradients gives zeros for an unused output of an op it differentiates,
                # which it does when its walk from xs reaches one of the op's inputs.
                if reach is None:
                    reach = graph_lib.reached_by_tf_gradients(xs, region)
                if any(t.op in reach for t in x.op.inputs):
                    g = rewrite.unused_output_gradient(x)
            if g is None and self._options.unconnected == tf.UnconnectedGradients.ZERO:
                g = rewrite.zeros_like_gradient(x)
            results.append(g)
        return results


class _ReadersOfPendingGradients:
    """Which ops descend from an op that reads a gradient a segment still has to read.

    A recomputation must not wait for such an op.  Fusing two ops closes a cycle
    exactly when a path leads from one to the other through a third op; a wait
    makes every op above the waited-for op come before every op below the
    waiting proxy.  Two readers of one value are fusable siblings (oneDNN fuses
    ``BiasAddGrad`` with ``Conv2DBackpropFilter`` of the same gradient), so a
    reader above the wait and another below it would become one op that waits
    for itself.  Values are compared after removing the identities and
    same-shape reshapes grappler removes (``graph.value_root``).

    Each op is visited once, the first time a wait asks about it or a descendant:
    its mark is the set of pending values it descends from a reader of, so the
    walk stays linear.  A back edge of a v1 loop (``NextIteration`` into
    ``Merge``) adds nothing to the mark of the op it leads to.
    """

    def __init__(self, graph: tf.Graph):
        self._oldest = graph_lib.last_op_id(graph)  # older ops read no gradient of ours
        self._marks: dict = {}  # op -> frozenset of value roots, for every op visited

    def safe_to_wait_for(self, ops: list, pending: list) -> list:
        """The ops of ``ops`` that descend from no reader of a ``pending`` gradient."""
        roots = frozenset(graph_lib.value_root(t) for t in pending)
        return [op for op in ops if not self._mark(op, roots) & roots]

    def _mark(self, op: tf.Operation, roots: frozenset) -> frozenset:
        """The pending values ``op`` descends from a reader of (each op is visited once)."""
        stack = [op]
        visiting: set = set()  # on the walk's path: a v1 loop's back edge leads back to one
        while stack:
            current = stack[-1]
            if current in self._marks:
                stack.pop()
                continue
            above = [t.op for t in current.inputs] + list(current.control_inputs)
            if current not in visiting:
                visiting.add(current)
                todo = [a for a in above if a not in self._marks and a not in visiting
                        and graph_lib.op_order(a) > self._oldest]
                if todo:
                    stack.extend(todo)
                    continue
            stack.pop()
            marks = set()
            for a in above:
                marks.update(self._marks.get(a, ()))
            if not graph_lib.forwards_its_input(current):
                marks.update(root for root in map(graph_lib.value_root, current.inputs)
                             if root in roots)
            # a value not pending now is never read as it is by a later segment
            self._marks[current] = frozenset(marks & roots)
        return self._marks[op]


def _naming_original(error: LookupError, ops, copies) -> LookupError:
    """TensorFlow's "no gradient" error about a recomputed copy, naming the user's op."""
    message = str(error)
    for op in ops:
        if op.outputs and f"'{copies[op.outputs[0].ref()].op.name}'" in message:
            copy_name = copies[op.outputs[0].ref()].op.name
            return LookupError(
                message.replace(f"'{copy_name}'", f" '{op.name}'", 1)
                + f" (Raised while differentiating its recomputed copy '{copy_name}'.)"
            )
    return error


def _as_list(value) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _numbers_as_constants(ys: list, xs: list) -> list:
    """``ys`` with each Python or NumPy number made a constant, as ``tf.gradients``
    converts one (it adds nothing to the gradients): of the first tensor's graph among
    ys, else among xs, else of the default graph when building one."""
    graph = next((t.graph for t in ys + xs if isinstance(t, tf.Tensor)
                  and getattr(t, "graph", None) is not None), None)
    if graph is None and not tf.executing_eagerly():
        graph = tf.compat.v1.get_default_graph()
    if graph is None:
        return ys
    numbers = (int, float, np.number, np.ndarray)
    with graph.as_default():
        return [tf.constant(y) if isinstance(y, numbers) and not isinstance(y, bool) else y
                for y in ys]


def _tensor_list(value, what: str) -> list:
    items = _as_list(value)
    if not items:
        raise ValueError(f"{what} is empty: pass at least one tensor.")
    tensors = []
    for item in items:
        if _is_resource_variable(item) or _tf_internals.reference_variable_tensor(item) is not None:
            item = tf.convert_to_tensor(item)
        if not isinstance(item, tf.Tensor):
            raise TypeError(
                f"{what} must be tensors of the graph being differentiated; got "
                f"{_describe(item)}."
            )
        tensors.append(item)
    return tensors


def _x_tensors(xs: list, graph: tf.Graph) -> list:
    """xs as graph tensors: a resource variable becomes its handle, as in tf.gradients."""
    if not xs:
        raise ValueError("xs is empty: pass at least one tensor or variable.")
    tensors = []
    for x in xs:
        if _is_resource_variable(x):  # as tf.gradients: its handle
            x = x.handle
            if not isinstance(x, tf.Tensor) or not hasattr(x, "graph") or x.graph is not graph:
                x = tf.convert_to_tensor(x)  # captures an eager handle in a tf.function
                if getattr(x, "graph", graph) is not graph and hasattr(graph, "capture"):
                    x = graph.capture(x)  # a v1 graph's variable used in a tf.function
        elif (ref := _tf_internals.reference_variable_tensor(x)) is not None:
            x = ref  # a v1 reference variable, as tf.gradients: its ref tensor
        elif isinstance(x, tf.Tensor) and getattr(x, "graph", None) is None:
            x = tf.convert_to_tensor(x)  # an eager tensor: captured, as tf.gradients does
        if not isinstance(x, tf.Tensor):
            raise TypeError(
                f"xs must be tensors or variables of the graph; got {_describe(x)}. Pass "
                "the tf.Variable (or the graph tensor) to differentiate with respect to"
                + ("; an array is a constant, which has no gradient." if hasattr(x, "shape")
                   else ".")
            )
        tensors.append(x)
    return tensors


def not_checkpoints_error(checkpoints) -> TypeError:
    """The error for ``checkpoints`` that are neither a strategy name nor tensors."""
    return TypeError(
        f"checkpoints must be a strategy name {strategies.available()} or a list of "
        f"tensors; got {type(checkpoints).__name__}."
    )


def _checkpoint_list(checkpoints) -> list:
    if isinstance(checkpoints, tf.Tensor):
        checkpoints = [checkpoints]
    if not isinstance(checkpoints, (list, tuple)):
        raise not_checkpoints_error(checkpoints)
    if not checkpoints:
        raise ValueError(
            "checkpoints is an empty list: pass the tensors to keep, or a strategy "
            f"name such as 'memory' (one of {strategies.available()})."
        )
    for t in checkpoints:
        if not isinstance(t, tf.Tensor):
            hint = (" A variable is no activation: checkpoint a tensor computed from it "
                    "(e.g. a layer's output)." if _is_resource_variable(t) else "")
            if isinstance(t, str):
                hint = (" Pass the tensor, not its name: graph.get_tensor_by_name(name) "
                        "gives it (a name with ':0' at its end).")
            elif isinstance(t, tf.Operation):
                hint = " Pass one of the op's outputs (op.outputs[0]), not the op."
            if "KerasTensor" in type(t).__name__:
                hint = (" A Keras functional model's symbolic tensor (layer.output, "
                        "model.output) is not a tensor of the step: collect the layers' "
                        "outputs while the step runs the model, or pass a strategy such "
                        "as 'memory'.")
            raise TypeError(
                f"every checkpoint must be a tf.Tensor of the graph; got {_describe(t)}.{hint}"
            )
    return list(checkpoints)


def _describe(value) -> str:
    """A one-line description of a value of the wrong kind (no multi-line array repr)."""
    kind = f"{type(value).__module__}.{type(value).__name__}".replace("builtins.", "")
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"a {kind} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = " ".join(repr(value).split())
    return f"{kind} {text[:60] + '...' if len(text) > 60 else text}"


def _check_same_graph(tensors, graph, what: str, ys: Sequence[tf.Tensor] = ()) -> None:
    """ValueError naming the first of ``tensors`` that is not in ``graph``, ys' graph (and,
    with ``ys``, the first of ys, so that either side of the mistake is named)."""
    for t in tensors:
        if getattr(t, "graph", None) is not graph:
            if getattr(t, "graph", None) is None:  # an eager tensor: a value, not a node
                raise ValueError(
                    f"{what}: an eager tensor of shape {tuple(t.shape)} and dtype "
                    f"{t.dtype.name} is a value computed outside the graph being "
                    "differentiated (e.g. before the tf.function was called). Compute it "
                    "from ys' and xs' graph: inside the tf.function, or under the same graph."
                )
            name = t.name
            first_y = ""
            if ys:
                same = " (another tensor of that name)" if ys[0].name == name else ""
                first_y = f", the graph of ys[0] {ys[0].name!r}{same}"
            raise ValueError(
                f"{what}: tensor {name!r} belongs to another graph than ys{first_y}. "
                "Every tensor must come from the graph being differentiated: build ys, xs "
                "and checkpoints under the same graph."
            )


def _grad_ys_list(grad_ys, ys: list, names: tuple = ("grad_ys", "ys", "y")) -> list:
    """``grad_ys`` as a list, one per y (None: ones), checked before anything is built:
    each tensor from ys' graph, each with its y's shape, and each tensor of its y's dtype
    (``tf.gradients`` finds such mistakes only while it builds, leaving ops behind).
    ``names``: what the caller calls grad_ys, ys and one y (a tape: output_gradients,
    target, target)."""
    if grad_ys is None:
        return [None] * len(ys)
    g, y_name, one_y = names
    grad_ys = list(_as_list(grad_ys))
    if len(grad_ys) != len(ys):
        raise ValueError(f"Length mismatch. Passed {len(grad_ys)} {g} for {len(ys)} {y_name}")
    for i, (grad_y, y) in enumerate(zip(grad_ys, ys)):
        if grad_y is None or isinstance(grad_y, tf.IndexedSlices):
            continue
        if _is_resource_variable(grad_y) or _tf_internals.reference_variable_tensor(grad_y) is not None:
            with y.graph.as_default():  # its value, as tf.gradients converts it
                grad_y = grad_ys[i] = tf.convert_to_tensor(grad_y)
        if (isinstance(grad_y, tf.Tensor) and getattr(grad_y, "graph", None) is None
                and hasattr(y.graph, "capture")):
            with y.graph.as_default():  # an eager tensor: captured, as tf.gradients does
                grad_y = grad_ys[i] = tf.convert_to_tensor(grad_y)
        if isinstance(grad_y, tf.Tensor):
            _check_same_graph([grad_y], y.graph, f"{g}[{i}]", ys)
            shape, dtype = grad_y.shape, grad_y.dtype
        else:
            try:
                array = np.asarray(grad_y)
            except (TypeError, ValueError, NotImplementedError):  # (a list of graph tensors)
                continue  # tf.gradients' own conversion says what is wrong with it
            if array.dtype.kind not in "biufc":  # tf.gradients builds ops, then raises
                raise TypeError(
                    f"{g}[{i}] is {_describe(grad_y)}: each of {g} is the gradient of its "
                    f"{one_y} (a tensor or number of its shape), or None for ones."
                    + (" gradients()' third argument is grad_ys, as tf.gradients': pass "
                       "checkpoints= by keyword." if g == "grad_ys" and isinstance(grad_y, str)
                       else ""))
            shape, dtype = tf.TensorShape(array.shape), None
        if not shape.is_compatible_with(y.shape):
            raise ValueError(
                f"{g}[{i}] has shape {shape}, but {y_name}[{i}] {y.name!r} has shape "
                f"{y.shape}: each of {g} is the gradient of its {one_y}, and has that "
                f"{one_y}'s shape")
        if dtype is not None and dtype.base_dtype != y.dtype.base_dtype:
            raise TypeError(
                f"{g}[{i}] has dtype {dtype.name}, but {y_name}[{i}] {y.name!r} has dtype "
                f"{y.dtype.name}: cast it (tf.cast) to its {one_y}'s dtype")
    return grad_ys


def check_output_gradients(output_gradients: list, targets: list) -> None:
    """A tape's ``output_gradients`` checked as :func:`gradients` checks ``grad_ys``, in
    the tape's own words."""
    _grad_ys_list(output_gradients, targets, ("output_gradients", "target", "target"))

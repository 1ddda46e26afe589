"""What the entry points did: one INFO line per rewrite, and a record of the plans.

Layer: transform; imports: notices, recovery, _units (planning, schedule, _tensorflow
for type hints only).

A :class:`Record` belongs to one entry point (a ``patch()``, a model's
``keras.enable``, a ``GradientTape``).  While the entry point's gradients
run, :func:`recording` makes it current; :func:`~.checkpointing.gradients`
then counts the call and, for every backward pass it rewrites, logs one
INFO line (where, strategy, checkpoints, predicted peaks, recomputation)
and appends the :class:`~.planning.Plan` to the record.  When the entry
point ends, :func:`warn_if_nothing_rewritten` says so if it rewrote
nothing, with the likely cause.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import threading
import weakref
from typing import TYPE_CHECKING, Iterator

from . import notices, recovery
from ._units import MIB

if TYPE_CHECKING:
    from ._tensorflow import tf
    from .planning import Plan
    from .schedule import Schedule

logger = logging.getLogger("memory_saving_gradients")


class Record:
    """What :func:`~.checkpointing.gradients` did for one entry point.

    Attributes:
      where: how the INFO line names what is traced (e.g. a Keras model), or
        None to name the traced function.
      plans: the :class:`~.planning.Plan` of every backward pass rewritten.
      schedules: the :class:`~.schedule.Schedule` every rewrite built, in order.
      calls: gradient computations that went through the library.
      eager: tape gradients that ran eagerly (nothing can be rewritten there).
      plain: why other tape gradients were left to TensorFlow, with counts.
      traced: the graphs rewritten under each name, in order (TensorFlow may
        trace one function more than once, e.g. tf_keras' ``train_function``).
      tapes: whether its entry point rewrites tape gradients (``patch(tape=False)``
        replaces only the ``gradients`` names).
      nested: the records of patches applied while this one was active: they rewrite
        in its place.
      ran: names of the traced functions it ran (eagerly) whose gradients the library
        planned when they were traced (under an earlier patch), with counts.
      ran_plain: names of the traced functions it ran that compute gradients the
        library never planned (traced before any patch), with counts.
      ran_plain_captures: ids of the eager values (variable handles among them)
        those functions captured: which Keras models' steps they were.
      ran_without_gradients: names of the traced functions it ran that compute no
        gradient (a Keras ``predict`` or ``evaluate``), with counts.
    """

    def __init__(self, where: str | None = None):
        self.where = where
        self.plans: list = []
        self.schedules: list = []
        self.calls = 0
        self.eager = 0
        self.plain: collections.Counter = collections.Counter()
        self.warned = False
        self.traced: dict[str, list[int]] = collections.defaultdict(list)
        self.tapes = True
        self.nested: list[Record] = []
        self.ran: collections.Counter = collections.Counter()
        self.ran_plain: collections.Counter = collections.Counter()
        self.ran_plain_captures: set[int] = set()
        self.ran_without_gradients: collections.Counter = collections.Counter()
        self.raised: collections.Counter = collections.Counter()  # error type -> calls


_local = threading.local()


def _stack() -> list:
    if not hasattr(_local, "records"):
        _local.records = []
    return _local.records


def current() -> Record | None:
    """The record of the innermost entry point whose gradients run now, or None."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def recording(record: Record | None) -> Iterator[None]:
    """Make ``record`` current inside the block (nothing changes for None)."""
    if record is None:
        yield
        return
    stack = _stack()
    stack.append(record)
    try:
        yield
    finally:
        stack.pop()


def wanted() -> bool:
    """Whether a rewrite's plan is seen by anyone (a record, or INFO logging)."""
    return current() is not None or logger.isEnabledFor(logging.INFO)


def called() -> None:
    """Count one gradient computation for the current record."""
    record = current()
    if record is not None:
        record.calls += 1


def raised(error: BaseException, record: Record | None = None, counted: bool = True) -> None:
    """A gradient computation raised ``error``: count it apart (for ``record``, by default
    the current one), so that a warning does not say it used plain tf.gradients;
    ``counted``: it was counted by :func:`called`."""
    record = record or current()
    if record is not None:
        if counted and record.calls:
            record.calls -= 1
        record.raised[type(error).__name__] += 1


def called_plain(reason: str, graph: tf.Graph | None = None) -> None:
    """The gradient computation just counted (:func:`called`) is TensorFlow's own, for
    ``reason``: count it among :attr:`Record.plain`, so that a warning names why."""
    record = current()
    if record is not None and record.calls:
        record.calls -= 1
    left_plain(record, reason, graph)


def ran_eagerly(record: Record | None) -> None:
    if record is not None:
        record.eager += 1


def left_plain(record: Record | None, reason: str, graph: tf.Graph | None = None) -> None:
    """Count a tape gradient left to TensorFlow, and why; ``graph``: where it was traced."""
    planned(graph)
    if record is not None:
        record.plain[reason] += 1


def scheduled(schedule: Schedule) -> None:
    """Keep the backward schedule a rewrite builds, for the current record."""
    record = current()
    if record is not None:
        record.schedules.append(schedule)


#: Graphs in which the library planned gradients (rewritten or left plain), and the
#: graphs they were traced in (a Keras step's gradient is built in a function nested
#: in the one that runs).
_planned_graphs: weakref.WeakSet = weakref.WeakSet()
#: Whether a traced graph the library never planned builds gradients (its own ops or
#: those of the functions it calls), by graph.
_builds_gradients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: The name scopes of gradient ops: tapes', and tf.gradients' (``gradients``, ``gradients_1``).
_GRADIENT_SCOPE = re.compile(r"(^|/)(gradient_tape|gradients(_\d+)?)/")


#: The ``train_function`` of each Keras model whose step the library planned.
_planned_train_functions: weakref.WeakSet = weakref.WeakSet()


def planned(graph: tf.Graph | None) -> None:
    """Remember that the library planned gradients in ``graph`` (see :func:`function_ran`),
    and in the train function of the Keras model being traced, if any."""
    while graph is not None and graph not in _planned_graphs:
        _planned_graphs.add(graph)
        graph = getattr(graph, "outer_graph", None)
    model = recovery.keras_model_being_traced()
    function = getattr(model, "train_function", None) if model is not None else None
    if function is not None:
        with contextlib.suppress(TypeError):  # not weakly referable
            _planned_train_functions.add(function)


def _planned_train_function(model: object) -> bool:
    with contextlib.suppress(TypeError):
        return getattr(model, "train_function", None) in _planned_train_functions
    return False


_rewrites_lock = threading.Lock()
_rewrites_in: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> count


def rewrote(plan: Plan, graph: tf.Graph) -> None:
    """Log one INFO line for a rewritten backward pass and keep its plan."""
    record = current()
    if record is not None:
        record.plans.append(plan)
    with _rewrites_lock:  # replicas' gradients are built on threads of their own
        count = _rewrites_in[graph] = _rewrites_in.get(graph, 0) + 1
    if not logger.isEnabledFor(logging.INFO):
        return
    mb = MIB
    what = where(graph, record)
    again = ""
    if record is not None:
        graphs = record.traced[what]
        if id(graph) not in graphs:
            graphs.append(id(graph))
        if len(graphs) > 1:
            # a graph does not say which Python function it traces: a retrace and
            # another function of the same name look alike here
            again = (f" (trace {graphs.index(id(graph)) + 1} under this name: traced again "
                     "by TensorFlow, or another function of the same name)")
    if count > 1:  # micro-batches' tapes, replicas: one line each
        again += f" (backward pass {count} in this graph)"
    in_step = (f" ({plan.in_step_ratio:.2f}x in a step that applies each gradient as it "
               f"is made)" if plan.in_step_differs() else "")
    # a list reads as a list, not as a strategy named 'list'
    chosen = "a list" if plan.strategy == "list" else repr(plan.strategy)
    logger.info(
        "rewrote the gradients of %s%s: checkpoints=%s, %d "
        "checkpoints (%.2f MB), predicted peak %.2f MB vs %.2f MB plain (%.2fx)%s%s, recomputation "
        "%.2f of a forward pass",
        what, again, chosen, len(plan.checkpoints), plan.checkpoint_bytes / mb,
        plan.predicted_peak_bytes / mb, plan.baseline_peak_bytes / mb, plan.predicted_ratio,
        in_step, _at_batch(plan), plan.recompute_cost,
    )


def _at_batch(plan: Plan) -> str:
    """Where the graph has unknown sizes: the size the figures are at, and the step's
    ratio at the planning batches (``Plan.peak_at`` gives any other)."""
    if not plan.depends_on_batch:
        return ""
    if plan.batch_stated:
        return f" at batch_size={plan.batch}, as passed"
    ratios = ", ".join(f"{b}: {ratio:.2f}x" for b, ratio in plan.ratios_by_batch(in_step=True))
    return (f" at an unknown size counted as {plan.batch} (in a step, by batch: {ratios}; "
            f"Plan.peak_at(batch) for the batch you feed)")


def function_ran(record: Record, graph: tf.Graph) -> None:
    """Count a traced function ``record``'s entry point ran: one whose gradients the
    library planned when it was traced (under an earlier patch), one with gradients it
    never saw (traced before any patch), or neither."""
    name = getattr(graph, "name", None) or "?"
    if graph in _planned_graphs:
        record.ran[name] += 1
        return
    builds = _builds_gradients.get(graph)
    if builds is None:
        definition = graph.as_graph_def()
        names = [node.name for node in definition.node] + [
            node.name for function in definition.library.function for node in function.node_def]
        builds = _builds_gradients[graph] = any(_GRADIENT_SCOPE.search(n) for n in names)
    if builds:
        record.ran_plain[name] += 1
        record.ran_plain_captures.update(id(value) for value in getattr(graph, "external_captures", ()))
    else:
        record.ran_without_gradients[name] += 1


def _stale_keras_models(record: Record) -> str:
    """The Keras models whose step, built before the patch, ran in the block (where
    TensorFlow's runs are not observed: every model with a ``train_function`` it did
    not plan)."""
    ran = recovery.keras_models_captured_by(record.ran_plain_captures)
    candidates = recovery.keras_models_with_train_function() if ran is None else ran
    names = [getattr(model, "name", "?") for model in candidates
             if not _planned_train_function(model)]
    if not names:
        return ""
    if ran is None:
        return f". Keras models whose train_function was built before: {_listed(names)}"
    return f". The Keras models it trained with a train_function built before: {_listed(names)}"


def _listed(names: list) -> str:
    """The first five of ``names``, quoted, and ``...`` if there are more."""
    return ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")


def _named(counts: collections.Counter) -> str:
    return _listed([name for name, _ in counts.most_common()])


def where(graph: tf.Graph, record: Record | None = None) -> str:
    """What is being traced: the record's name for it, a Keras model, or the function."""
    if record is not None and record.where:
        label = record.where
    else:
        model = recovery.keras_model_being_traced()
        label = f"Keras model {getattr(model, 'name', '?')!r}" if model is not None else None
    function = _function_name(graph)
    return f"{label} ({function})" if label else function


def _function_name(graph: tf.Graph) -> str:
    """The traced function, with the functions it is nested in (a loop body names its step)."""
    names = []
    while graph is not None and getattr(graph, "name", None):
        if not names or names[-1] != graph.name:
            names.append(graph.name)
        graph = getattr(graph, "outer_graph", None)
    if not names:
        return "a tf.compat.v1 graph"
    return " in ".join(f"function {name!r}" for name in names)


def _raised(record: Record) -> str:
    return ", ".join(f"{n}x {name}" for name, n in record.raised.most_common())


def warn_if_nothing_rewritten(record: Record, what: str) -> None:
    """Once per record: a warning naming the likely cause, if nothing was rewritten."""
    if record.plans or record.warned:
        return
    record.warned = True
    by_nested = sum(len(inner.plans) for inner in record.nested)
    if by_nested:
        logger.info("%s rewrote nothing itself: patches applied inside it rewrote %d "
                    "backward pass(es) in its place (their handles' plans list them).",
                    what, by_nested)
        return
    if record.ran and not (record.ran_plain or record.eager or record.calls or record.plain
                           or record.raised):
        logger.info("%s built no gradient itself: the step(s) it ran (%s) were planned "
                    "by another entry point, whose settings hold for them: an earlier "
                    "patch they were traced under, or keras.enable on their model (its "
                    "plans and messages say what it rewrote).", what, _named(record.ran))
        return
    if record.eager:
        category = notices.EagerExecutionWarning
        cause = (
            f"{record.eager} tape gradient(s) ran eagerly, where nothing can be rewritten: "
            "trace the step in a tf.function (for Keras: compile without run_eagerly=True)"
        )
    elif record.calls:
        category = notices.NothingRewrittenWarning
        cause = (
            f"its {record.calls} gradient computation(s) kept no checkpoint and used plain "
            "tf.gradients (a NothingKeptWarning says why the first time a graph of that "
            "structure is planned)"
        )
    elif record.raised:
        category = notices.NothingRewrittenWarning
        cause = (f"its {sum(record.raised.values())} gradient computation(s) raised "
                 f"({_raised(record)}) and built nothing: the error says why")
    elif record.plain:
        category = notices.NothingRewrittenWarning
        reasons = "; ".join(f"{n}x {reason}" for reason, n in record.plain.most_common())
        cause = (f"every tape gradient built while it was active was left to TensorFlow "
                 f"({reasons}): those are computed by plain TensorFlow, as documented")
    elif not record.tapes:
        category = notices.NothingRewrittenWarning
        cause = (
            "no tf.gradients call was traced while it was active, and with tape=False "
            "tf.GradientTape.gradient (Keras fit, most TF2 training steps) stays "
            "TensorFlow's own: pass tape=True (the default) to rewrite tapes too. A step "
            "that calls tf.gradients may also have been traced before the patch (a "
            "tf.function called earlier reuses its graph)"
        )
    else:
        category = notices.NothingRewrittenWarning
        ran = (f": it ran {_named(record.ran_plain)}, whose gradients no patch planned "
               "(traced before this patch or under one with tape=False, and reused; or "
               "built only by functions the patch leaves to TensorFlow: tf.hessians, "
               "a tape's jacobian, a ForwardAccumulator)" if record.ran_plain else
               f": the traced functions it ran ({_named(record.ran_without_gradients)}) "
               "compute no gradient (a Keras predict or evaluate), so there was nothing "
               "to rewrite" if record.ran_without_gradients else
               ". Most likely the step was traced before it: a tf.function called "
               "earlier, or a Keras model that already ran fit (or train_on_batch), "
               "reuses its graph")
        cause = (
            f"no gradient was built while it was active{ran}. Trace the step inside the "
            "patch for the first time: wrap the step in a new tf.function, or for Keras call "
            "model.compile(...) again or use memory_saving_gradients.keras.enable(model), "
            "which retraces. Gradients computed eagerly (outside tf.function, or with "
            "run_eagerly=True) cannot be rewritten either"
        )
        cause += _stale_keras_models(record)
    if record.plain and (record.eager or record.calls):
        reasons = "; ".join(f"{n}x {reason}" for reason, n in record.plain.most_common())
        cause += f". Tape gradients left to TensorFlow: {reasons}"
    if record.raised and (record.eager or record.calls or record.plain):
        cause += f". Gradient computations that raised: {_raised(record)}"
    notices.warn(f"{what} rewrote nothing: {cause}.", category)

"""``GradientTape``: a ``tf.GradientTape`` whose ``gradient()`` checkpoints inside ``tf.function``.

Inside a ``tf.function`` the operations the tape saw are ops of the function
graph, so ``gradient()`` can build the backward pass with
:func:`~memory_saving_gradients.gradients` on that graph instead of replaying
the tape.  The result follows the tape's rules:

* only ops created while the tape was recording are differentiated through
  (tensors made before ``__enter__`` or under ``stop_recording()`` are
  constants for it, as for ``tf.GradientTape``);
* variables the tape did not watch, and tensors made outside the tape that
  were never ``watch``-ed, get ``None`` (or zeros with
  ``unconnected_gradients='zero'``);
* sources and the result may be nested structures (``tf.nest``).

In eager mode nothing is a graph, so nothing can be recomputed: ``gradient()``
returns ``tf.GradientTape``'s own result and logs that once per process.
Targets or sources that are composite tensors (ragged, sparse) also fall back
to the tape, with a log line.
"""

from __future__ import annotations

import logging
import threading

from ._tensorflow import tf
from . import graph as graph_lib
from .checkpointing import gradients as _checkpointed_gradients

logger = logging.getLogger("memory_saving_gradients")

_eager_warned = threading.Event()


class GradientTape(tf.GradientTape):
    """Drop-in for ``tf.GradientTape`` that saves memory when used in a ``tf.function``.

    Args:
      checkpoints: strategy name (``'memory'``, ``'speed'``, ``'collection'``)
        or a list of tensors, as in :func:`memory_saving_gradients.gradients`.
      persistent, watch_accessed_variables: as in ``tf.GradientTape``.
      **options: more keyword arguments for ``gradients`` (``memory_budget``,
        ``gate_gradients``, ``aggregation_method``,
        ``colocate_gradients_with_ops``).
    """

    def __init__(
        self,
        checkpoints="memory",
        persistent: bool = False,
        watch_accessed_variables: bool = True,
        **options,
    ):
        super().__init__(persistent=persistent, watch_accessed_variables=watch_accessed_variables)
        self.checkpoints = checkpoints
        self.options = options
        self._graph = None
        self._ranges: list = []  # [first op id, last op id] recorded, per graph span
        self._open_from = None  # first op id of the span being recorded
        self._watched_tensors: dict = {}  # tensor.ref() -> tensor

    # -- recording spans: which ops of the function graph the tape saw --------

    def _push_tape(self):
        super()._push_tape()
        if tf.executing_eagerly():
            return
        graph = tf.compat.v1.get_default_graph()
        if self._graph is not graph:
            self._graph, self._ranges, self._watched_tensors = graph, [], {}
        self._open_from = _last_op_id(graph) + 1

    def _pop_tape(self):
        super()._pop_tape()
        self._close_span()

    def _close_span(self):
        if self._open_from is not None and self._graph is not None:
            self._ranges.append((self._open_from, _last_op_id(self._graph)))
        self._open_from = None

    def reset(self):
        super().reset()
        if self._graph is not None and not tf.executing_eagerly():
            self._ranges, self._watched_tensors = [], {}
            self._open_from = _last_op_id(self._graph) + 1

    def watch(self, tensor):
        super().watch(tensor)
        if not tf.executing_eagerly():
            for t in tf.nest.flatten(tensor):
                if isinstance(t, tf.Tensor):
                    self._watched_tensors[t.ref()] = t

    # -- gradient ---------------------------------------------------------------

    @tf.autograph.experimental.do_not_convert
    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=tf.UnconnectedGradients.NONE,
    ):
        """As ``tf.GradientTape.gradient``; checkpointed inside a ``tf.function``."""
        if tf.executing_eagerly():
            if not _eager_warned.is_set():
                _eager_warned.set()
                logger.warning(
                    "memory_saving_gradients.GradientTape.gradient ran eagerly: "
                    "nothing can be recomputed in eager mode, so these are plain "
                    "tf.GradientTape gradients (no memory saved). Call it inside a "
                    "tf.function to save memory. (Logged once.)"
                )
            return super().gradient(target, sources, output_gradients, unconnected_gradients)
        if target is None:
            raise TypeError(
                "Argument `target` should be a list or nested structure of Tensors, "
                "Variables or CompositeTensors to be differentiated, but received None."
            )
        flat_targets = tf.nest.flatten(target)
        flat_sources = tf.nest.flatten(sources)
        unsupported = [
            t for t in flat_targets + flat_sources
            if not (isinstance(t, tf.Tensor) or _as_variable(t) is not None)
        ]
        if unsupported:
            logger.warning(
                "memory_saving_gradients.GradientTape: %s is not a dense tensor or "
                "variable; using tf.GradientTape's own gradient (no memory saved).",
                type(unsupported[0]).__name__,
            )
            return super().gradient(target, sources, output_gradients, unconnected_gradients)
        if self._tape is None:
            raise RuntimeError(
                "A non-persistent GradientTape can only be used to compute one set "
                "of gradients (or jacobians)"
            )
        if self._recording:
            if not self._persistent:
                self._pop_tape()
            else:
                # Keep recording, but the ops made so far are what gets differentiated.
                self._close_span()
                self._open_from = _last_op_id(self._graph) + 1
        watched_variables = self.watched_variables()
        if not self._persistent:
            self._tape = None  # as tf.GradientTape: one gradient() per tape

        ys = [_as_target(t) for t in flat_targets]
        graph = ys[0].graph
        if graph is not self._graph:
            raise ValueError(
                "memory_saving_gradients.GradientTape: the target was not computed "
                "in the graph (tf.function) where the tape recorded."
            )
        grad_ys = None
        if output_gradients is not None:
            grad_ys = [
                None if g is None else tf.convert_to_tensor(g)
                for g in tf.nest.flatten(output_gradients)
            ]

        watched_handles = {id(_as_variable(v)) for v in watched_variables}
        connected, xs = [], []
        for i, s in enumerate(flat_sources):
            variable = _as_variable(s)
            if variable is not None:
                if id(variable) in watched_handles:
                    connected.append(i)
                    xs.append(variable)
            elif self._recorded(s.op) or s.ref() in self._watched_tensors:
                connected.append(i)
                xs.append(s)

        results = [None] * len(flat_sources)
        if xs:
            stops = self._unrecorded_inputs(graph, xs)
            grads = _checkpointed_gradients(
                ys,
                xs,
                grad_ys,
                checkpoints=self.checkpoints,
                stop_gradients=stops or None,
                unconnected_gradients=unconnected_gradients,
                **self.options,
            )
            for i, g in zip(connected, grads):
                results[i] = g
        if tf.UnconnectedGradients(unconnected_gradients) == tf.UnconnectedGradients.ZERO:
            for i, s in enumerate(flat_sources):
                if results[i] is None:
                    results[i] = tf.zeros_like(s)
        return tf.nest.pack_sequence_as(sources, results)

    def _recorded(self, op: tf.Operation) -> bool:
        order = graph_lib.op_order(op)
        return any(first <= order <= last for first, last in self._ranges)

    def _unrecorded_inputs(self, graph, xs) -> list:
        """Tensors that recorded ops read but that were made outside the tape.

        The tape does not differentiate through them, so neither do we:
        they go to ``stop_gradients`` (minus the xs themselves).
        """
        x_refs = {x.ref() for x in xs if isinstance(x, tf.Tensor)}
        stops: dict = {}
        ops = graph.get_operations()
        for first, last in self._ranges:
            for op in ops[_index_of_id(ops, first):]:
                if graph_lib.op_order(op) > last:
                    break
                for t in op.inputs:
                    if (
                        t.ref() not in x_refs
                        and graph_lib.is_differentiable(t)
                        and not self._recorded(t.op)
                    ):
                        stops.setdefault(t.ref(), t)
        return list(stops.values())


def _last_op_id(graph) -> int:
    ops = graph.get_operations()
    return graph_lib.op_order(ops[-1]) if ops else 0


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


def _as_variable(value):
    """The ``tf.Variable`` behind a source (a Keras 3 variable wraps one), or None."""
    if isinstance(value, tf.Variable):
        return value
    if isinstance(value, tf.Tensor):
        return None
    for attribute in ("_value", "value"):  # Keras 3 (TensorFlow backend) keeps it in _value
        inner = getattr(value, attribute, None)
        if isinstance(inner, tf.Variable):
            return inner
    return None


def _as_target(value) -> tf.Tensor:
    variable = _as_variable(value)
    if variable is not None:
        return variable.value()
    return value

"""The one door to TensorFlow's internals: the import check and every private symbol.

Layer: foundation (the one shim for TensorFlow's internals); imports: notices.

TensorFlow is the user's own build (``tensorflow``, ``tensorflow-cpu``, a
nightly, ...), so it is not a hard requirement of the package; this module
fails at import with a message that says how to install it, and warns once
when the installed 2.x is not the tested one (:data:`TESTED_TENSORFLOW`).

Every private TensorFlow module, function and attribute the library uses is
reached through the named functions and constants below, so that when a
TensorFlow release moves one, this file is where to look, and
``tests/test_tf_internals.py`` says which one moved.  The functions that
build or change graph structure (marked *rewrite.py only*) are thin forwards
to TensorFlow's private methods; only :mod:`.rewrite` calls them, so it stays
the one module that decides every change to a graph.

This module also keeps a reference to TensorFlow's ``gradients`` taken at
import time, before anything can monkeypatch it, so that this library never
calls itself through a patch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
import threading
import typing
import warnings

from . import notices

try:
    import tensorflow as tf
except ImportError as error:  # pragma: no cover - exercised only without TF
    raise ImportError(
        "memory_saving_gradients needs TensorFlow 2.x, which is not installed. "
        "Install the build you want, e.g. `pip install tensorflow-cpu` or "
        "`pip install tensorflow`, or install this package with an extra: "
        "`pip install memory_saving_gradients[cpu]` / `[gpu]`."
    ) from error

# -- the supported range -------------------------------------------------------

#: The TensorFlow release (major.minor) the library is tested on; pyproject.toml's
#: extras pin the same one.
TESTED_TENSORFLOW = "2.21"


def version_support(version: str) -> str:
    """How the library stands to a TensorFlow version string (pure).

    ``'tested'`` for the :data:`TESTED_TENSORFLOW` release (any patch level or
    pre-release of it), ``'untested'`` for another 2.x, ``'unsupported'`` for
    anything else (1.x, 3.x, unparsable).
    """
    match = re.match(r"(\d+)\.(\d+)", version.strip())
    if match is None or match.group(1) != "2":
        return "unsupported"
    return "tested" if f"2.{int(match.group(2))}" == TESTED_TENSORFLOW else "untested"


def _check_version(version: str) -> None:
    """Raise ImportError for an unsupported TensorFlow; warn once for an untested 2.x."""
    support = version_support(version)
    if support == "unsupported":
        raise ImportError(
            f"memory_saving_gradients needs TensorFlow 2.x (tested on {TESTED_TENSORFLOW}); "
            f"found {version}. Install e.g. `pip install memory_saving_gradients[cpu]`."
        )
    if support == "untested":
        warnings.warn(
            f"memory_saving_gradients is tested on TensorFlow {TESTED_TENSORFLOW}; found "
            f"{version}. It uses private TensorFlow API (all of it in "
            "memory_saving_gradients/_tensorflow.py), which may have moved: run "
            "tests/test_tf_internals.py to check.",
            notices.MemorySavingGradientsWarning, stacklevel=3,
        )


_check_version(tf.__version__)

# The private modules this shim stands between the library and (ruff: E402 allowed here).
from tensorflow.core.framework import attr_value_pb2 as _attr_value_pb2
from tensorflow.python.autograph.operators import control_flow as _autograph_control_flow
from tensorflow.python.client import device_lib as _device_lib
from tensorflow.python.eager import backprop as _backprop
from tensorflow.python.eager import backprop_util as _backprop_util
from tensorflow.python.eager import forwardprop as _forwardprop
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import op_def_registry as _op_def_registry
from tensorflow.python.framework import ops as _framework_ops
from tensorflow.python.ops import control_flow_ops as _control_flow_ops
from tensorflow.python.ops import control_flow_state as _control_flow_state
from tensorflow.python.ops import control_flow_util as _control_flow_util
from tensorflow.python.ops import custom_gradient as _custom_gradient
from tensorflow.python.ops import default_gradient as _default_gradient
from tensorflow.python.ops import gradients_impl as _gradients_impl
from tensorflow.python.ops import gradients_util as _gradients_util
from tensorflow.python.ops import resource_variable_ops as _resource_variable_ops
from tensorflow.python.ops import script_ops as _script_ops
from tensorflow.python.ops.control_flow_v2_func_graphs import (
    ControlFlowFuncGraph as _ControlFlowFuncGraph,
)
from tensorflow.python.util import tf_stack as _tf_stack

#: TensorFlow's own ``tf.compat.v1.gradients``, captured before any patching.
tf_gradients = _gradients_impl.gradients
#: TensorFlow's own ``tf.gradients`` (the TF2 signature), captured before any patching.
tf_gradients_v2 = _gradients_impl.gradients_v2

# -- ops and graphs (read only) ----------------------------------------------------

#: The class of v1 control-flow (``while_loop``, ``cond``) and XLA contexts.
ControlFlowContext = _control_flow_ops.ControlFlowContext


def op_id(op: tf.Operation) -> int:
    """An op's creation id (``Operation._id``): unique in its graph, increasing."""
    return op._id


def last_op_id(graph: tf.Graph) -> int:
    """Creation id of the newest op of ``graph`` (0 for an empty graph).

    Where the graph keeps its ops in a dict by id (``Graph._nodes_by_id``, in
    creation order: TensorFlow before 2.13's C++ graph) it is the dict's last
    key; otherwise (TensorFlow 2.21: an unordered C++ map) it is the id of the
    last op of :meth:`tf.Graph.get_operations`, which lists ops in creation
    order.
    """
    nodes = getattr(graph, "_nodes_by_id", None)
    if isinstance(nodes, dict):
        return next(reversed(nodes), 0)
    ops = graph.get_operations()
    return op_id(ops[-1]) if ops else 0


def control_flow_context(op: tf.Operation) -> ControlFlowContext | None:
    """The innermost v1 control-flow (or XLA) context ``op`` was made in, or None."""
    return op._control_flow_context


def graph_control_flow_context(graph: tf.Graph) -> ControlFlowContext | None:
    """The control-flow context ops made in ``graph`` now would get, or None."""
    return graph._get_control_flow_context()


def is_function_call(op: tf.Operation) -> bool:
    """Whether ``op`` calls a function of its graph's library by name (no OpDef of its own)."""
    return op.graph._is_function(op.type)


#: The source file of ``tf.py_function``'s runtime: it runs Python eagerly, from a graph.
_PY_FUNCTION_FILE = _script_ops.__file__


def running_in_py_function() -> bool:
    """Whether this Python code runs inside a ``tf.py_function`` (or ``numpy_function``)
    that a graph is executing: TensorFlow calls it eagerly, and differentiates it with
    an eager tape of its own."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == _PY_FUNCTION_FILE:
            return True
        frame = frame.f_back
    return False


#: Autograph's ``_try_handling_undefineds`` traces a loop body once in a throwaway
#: ``FuncGraph('tmp')`` when some loop variable is first set in the body, to learn its
#: type; the loop is then traced again, for real.  (function name, module name)
_AUTOGRAPH_STAGING = ("_try_handling_undefineds", _autograph_control_flow.__name__)
#: Where a ``tf.function`` traces its Python function into a graph of its own, named after
#: the function (a user's function may be called ``tmp``).  (function name, module name)
_FUNCTION_TRACE = ("func_graph_from_py_func", _func_graph.__name__)


#: Where a ``tf.autodiff.ForwardAccumulator`` traces an op's Jacobian-vector product: a
#: helper function, cached for the whole process, that differentiates the op twice with
#: tapes linked by ``record_gradient`` rather than by ops.  (function name, module name)
_JVP_HELPER = ("_jvp_helper", _forwardprop.__name__)


def in_forwardprop_helper_trace() -> bool:
    """Whether this code runs while a ``ForwardAccumulator`` traces one op's
    Jacobian-vector product (:data:`_JVP_HELPER`): TensorFlow's own machinery, whose
    tapes must stay TensorFlow's."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name, frame.f_globals.get("__name__")) == _JVP_HELPER:
            return True
        frame = frame.f_back
    return False


def autograph_origin(filename: str, lineno: int) -> tuple | None:
    """``(filename, lineno)`` of the user's line that a line of code autograph generated
    came from, by the source map of the conversion running on this thread (the one
    TensorFlow's own tracebacks use); None where none maps it."""
    try:  # a private map: no origin rather than an error, should TensorFlow change it
        stack = _tf_stack._source_mapper_stacks.get(threading.get_ident())
        found = stack[-1].get_effective_source_map().get((filename, lineno)) if stack else None
    except Exception:
        return None
    return (found[0], found[1]) if found else None


notices.origin_of_converted_line = autograph_origin


def in_autograph_staging_trace() -> bool:
    """Whether this code runs in autograph's throwaway trace of a loop body (see
    :data:`_AUTOGRAPH_STAGING`), or in a ``cond`` or loop inside it: nothing built
    there is ever run.  A function traced while it runs has a graph of its own."""
    graph = tf.compat.v1.get_default_graph()
    while isinstance(graph, _ControlFlowFuncGraph):
        graph = graph.outer_graph
    if getattr(graph, "name", None) != "tmp":
        return False
    frame = sys._getframe(1)
    while frame is not None:
        where = (frame.f_code.co_name, frame.f_globals.get("__name__"))
        if where == _FUNCTION_TRACE and frame.f_locals.get("func_graph") is graph:
            return False  # a function named tmp, traced into this graph
        if where == _AUTOGRAPH_STAGING:
            return True
        frame = frame.f_back
    return False


def captured_placeholder(graph, value):
    """The tensor through which a ``FuncGraph`` reads ``value``, a tensor from outside it
    (an eager tensor the traced function uses): a placeholder, or a ``Const`` for a small
    constant that TensorFlow inlines; None where it captured none."""
    for external, internal in getattr(graph, "captures", None) or ():
        if external is value:
            return internal
    return None


def while_body_graph(op: tf.Operation):
    """The body ``FuncGraph`` that a v2 ``While`` op built in this process keeps
    (``while_v2`` sets it on the op), or None (e.g. a loop imported from a GraphDef)."""
    return getattr(op, "_body_graph", None)


def while_cond_graph(op: tf.Operation):
    """The condition ``FuncGraph`` of a v2 ``While`` op built in this process, or None."""
    return getattr(op, "_cond_graph", None)


def static_value_in(graph, tensor: tf.Tensor):
    """``tensor``'s value where it is static, also where a ``FuncGraph`` captured it
    from an enclosing graph (a loop's condition reading the function's ``tf.range``
    limit); else None."""
    value = tf.get_static_value(tensor)
    if value is not None:
        return value
    for external, internal in getattr(graph, "captures", None) or ():
        if internal is tensor:
            return static_value_in(getattr(graph, "outer_graph", None), external)
    return None


def is_ref_dtype(dtype: tf.DType) -> bool:
    """Whether ``dtype`` is a v1 reference type (``float32_ref``, ...)."""
    return dtype._is_ref_dtype


def in_xla_context(graph: tf.Graph) -> bool:
    """Whether ops added to ``graph`` now are inside an XLA context (``jit_compile=True``
    functions and their nested bodies, v1 ``xla.compile``)."""
    return _control_flow_util.GraphOrParentsInXlaContext(graph)


def is_registered_op_type(op_type: str) -> bool:
    """Whether TensorFlow's op registry knows ``op_type``."""
    return _op_def_registry.get(op_type) is not None


def op_def(op_type: str):
    """The registered ``OpDef`` of ``op_type``, or None."""
    return _op_def_registry.get(op_type)


# -- gradients: TensorFlow's rules and registry ---------------------------------------


#: (dtype, quantized-training flag) -> ``IsTrainable``: a pure function of the two for
#: every dtype but ``variant`` (whose answer reads the tensor's handle data).
_TRAINABLE_DTYPES: dict = {}


def is_trainable(tensor: tf.Tensor) -> bool:
    """``backprop_util.IsTrainable``: whether a gradient flows through ``tensor``
    (remembered per dtype: the rewrite asks several times per tensor, ~5 us each)."""
    dtype = tensor.dtype
    if dtype.base_dtype == tf.variant:
        return _backprop_util.IsTrainable(tensor)
    key = (dtype, _backprop_util.flags.config().enable_quantized_dtypes_training.value())
    found = _TRAINABLE_DTYPES.get(key)
    if found is None:
        found = _TRAINABLE_DTYPES[key] = _backprop_util.IsTrainable(tensor)
    return found


def supports_default_grad(tensor: tf.Tensor) -> bool:
    """Whether ``tf.gradients`` fills zeros for ``tensor`` when no gradient reaches it."""
    return _default_gradient.supports_default_grad(tensor)


def gradient_function(op: tf.Operation):
    """The gradient function ``tf.gradients`` uses for ``op`` (None when ``tf.no_gradient``;
    LookupError when none is registered), looked up through the module attribute that
    ``tf.gradients`` itself calls (so it sees :func:`replace_gradient_function_lookup`)."""
    lookup = _framework_ops.get_gradient_function
    if lookup is ORIGINAL_GRADIENT_FUNCTION_LOOKUP:
        return original_gradient_function(op)
    return lookup(op)


#: TensorFlow's own ``ops.get_gradient_function``, captured at import.
ORIGINAL_GRADIENT_FUNCTION_LOOKUP = _framework_ops.get_gradient_function

_remembered = threading.local()  # .types: op -> the registry name of its gradient


@contextlib.contextmanager
def gradient_types_remembered():
    """Inside the block (this thread), :func:`original_gradient_function` reads each op's
    ``_gradient_op_type`` attribute once.  TensorFlow raises (and catches) an error
    for every op without one, about 13 us; the rewrite looks up each op's gradient
    several times.  An op gets that attribute when it is created
    (``gradient_override_map``), so a call's answers hold for the whole call."""
    outer = getattr(_remembered, "types", None)
    if outer is None:
        _remembered.types = {}
    try:
        yield
    finally:
        if outer is None:
            _remembered.types = None


def original_gradient_function(op: tf.Operation):
    """What :data:`ORIGINAL_GRADIENT_FUNCTION_LOOKUP` gives for ``op`` (None for an op
    without inputs or with ``tf.no_gradient``; LookupError when none is registered),
    by the same steps as TensorFlow 2.21's ``ops.get_gradient_function``, the
    attribute read once per op inside :func:`gradient_types_remembered`."""
    types = getattr(_remembered, "types", None)
    if types is None:
        return ORIGINAL_GRADIENT_FUNCTION_LOOKUP(op)
    if not op.inputs:
        return None
    function = op._gradient_function
    if function:
        return function
    op_type = types.get(op)
    if op_type is None:
        try:
            op_type = op.get_attr("_gradient_op_type")
        except ValueError:
            op_type = op.type
        types[op] = op_type
    return _framework_ops.gradient_registry.lookup(op_type)


def gradient_override_type(op: tf.Operation) -> str | None:
    """The registry name ``op``'s gradient is looked up by where a
    ``gradient_override_map`` set one (``_gradient_op_type``), else None."""
    types = getattr(_remembered, "types", None)
    if types is not None and op in types:
        found = types[op]
        return None if found == op.type else _as_str(found)
    try:
        return _as_str(op.get_attr("_gradient_op_type"))
    except ValueError:
        return None


def _as_str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


#: How ``tf.custom_gradient`` names the gradient it registers for the ``IdentityN`` of
#: each function it wraps (``custom_gradient.generate_name``).
CUSTOM_GRADIENT_PREFIX = "CustomGradient-"


def is_custom_gradient_op(op: tf.Operation) -> bool:
    """Whether ``op`` is the ``IdentityN`` a ``tf.custom_gradient`` function makes in a
    graph: its gradient is registered under :data:`CUSTOM_GRADIENT_PREFIX`.  An
    ``IdentityN`` under a hand-written ``gradient_override_map`` (a straight-through
    estimator) is not one: its inputs are not results and arguments."""
    found = gradient_override_type(op)
    return found is not None and found.startswith(CUSTOM_GRADIENT_PREFIX)


#: The source file of ``tf.custom_gradient``'s graph-mode wrappers: their closures hold
#: the function's results for their structure only, and its arguments.
_CUSTOM_GRADIENT_FILE = _custom_gradient.__file__

#: How many functions :func:`custom_gradient_closure_tensors` looks into at most, and
#: how deep into containers and objects.
_CLOSURE_FUNCTIONS = 64
_CLOSURE_DEPTH = 3


def custom_gradient_closure_tensors(op: tf.Operation) -> tuple | None:
    """``(own, wrappers')``: the tensors of ``op``'s graph that the Python gradient
    function of a ``tf.custom_gradient`` op (found by its ``_gradient_op_type``) holds:
    in its closure, in containers there (lists, tuples, dicts, a few levels deep), in
    the functions it holds (their closures, a ``functools.partial``'s arguments, a bound
    method's object's attributes); the docstring's ``log1pexp`` holds ``tf.exp(x)``,
    made inside the function.  Those that TensorFlow's own wrappers in
    ``custom_gradient.py`` hold are apart (the function's results, for their structure
    only; ``tf.recompute_grad``'s arguments, which it reads).  None for an op without
    an override function."""
    try:
        function = _framework_ops.gradient_registry.lookup(op.get_attr("_gradient_op_type"))
    except (ValueError, LookupError):
        return None
    own: dict = {}
    wrappers: dict = {}
    stack = [(function, own, 0)]  # (value, where its tensors go, container depth)
    seen: set = set()
    functions = 0
    while stack:
        value, found, depth = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, tf.Tensor):
            if getattr(value, "graph", None) is op.graph:
                found[value.ref()] = value
        elif isinstance(value, (list, tuple, set, frozenset, dict)):
            if depth < _CLOSURE_DEPTH:
                items = value.values() if isinstance(value, dict) else value
                stack.extend((item, found, depth + 1) for item in items)
        elif isinstance(value, functools.partial):  # its arguments are its function's
            found = wrappers if _is_custom_gradient_wrapper(value.func) else own
            stack.extend((item, found, depth) for item in
                         [value.func, *value.args, *value.keywords.values()])
        elif callable(value) and functions < _CLOSURE_FUNCTIONS:
            owner = getattr(value, "__self__", None)
            code_holder = getattr(value, "__func__", value)
            if getattr(code_holder, "__code__", None) is None:
                continue
            functions += 1
            found = wrappers if _is_custom_gradient_wrapper(value) else own
            if owner is not None and depth < _CLOSURE_DEPTH:  # a bound method's object
                stack.extend((item, found, depth + 1)
                             for item in getattr(owner, "__dict__", {}).values())
            for cell in code_holder.__closure__ or ():
                try:
                    stack.append((cell.cell_contents, found, depth))
                except ValueError:  # not yet filled
                    continue
    return list(own.values()), list(wrappers.values())


def _is_custom_gradient_wrapper(function) -> bool:
    """Whether ``function`` (or a bound method's) is defined in ``custom_gradient.py``."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    return code is not None and code.co_filename == _CUSTOM_GRADIENT_FILE


def replace_gradient_function_lookup(lookup) -> None:
    """Make ``tf.gradients`` find gradient functions through ``lookup(op)`` (pass
    :data:`ORIGINAL_GRADIENT_FUNCTION_LOOKUP` to put TensorFlow's back)."""
    _framework_ops.get_gradient_function = lookup


def registered_gradient(op_type: str):
    """The gradient function registered for ``op_type``, or None (also for
    ``tf.no_gradient`` types)."""
    try:
        return _framework_ops.gradient_registry.lookup(op_type)
    except LookupError:
        return None


def gradient_override(op: tf.Operation):
    """``Operation._gradient_function``: the per-op gradient that wins over the registry."""
    return op._gradient_function


def set_gradient_override(op: tf.Operation, function) -> None:
    """Set ``Operation._gradient_function`` (*rewrite.py only*)."""
    op._gradient_function = function


def zeros_like_output(op: tf.Operation, index: int) -> tf.Tensor:
    """``tf.gradients``' zeros for an unused output of ``op`` (``control_flow_state.ZerosLike``)."""
    return _control_flow_state.ZerosLike(op, index)


def zeros_like_unconnected(x: tf.Tensor) -> tf.Tensor:
    """``tf.gradients``' zeros for an unconnected ``x`` (``gradients_util._ZerosLike``)."""
    return _gradients_util._ZerosLike(x)


def default_grad_ys(grad_ys: list, ys: list, colocate_gradients_with_ops: bool, uid: str) -> list:
    """``gradients_util._DefaultGradYs``: ones where ``grad_ys`` is None, and its checks."""
    return _gradients_util._DefaultGradYs(grad_ys, ys, colocate_gradients_with_ops, uid)


#: ``control_flow_ops.tuple``: gradients joined so that none is ready before all are.
gated_tuple = _control_flow_ops.tuple

# -- graph building scopes and op construction (rewrite.py only) ------------------------

#: TensorFlow's graph-building scopes as ``tf.gradients`` uses them (v1 semantics:
#: ``device(None)`` and ``control_dependencies(None)`` clear what is inherited).
name_scope = _framework_ops.name_scope
device_scope = _framework_ops.device
control_dependencies = _framework_ops.control_dependencies
colocate_with = _framework_ops.colocate_with


def colocate_with_for_gradient(op: tf.Operation, uid: str):
    """``ops._colocate_with_for_gradient``: the scope ``colocate_gradients_with_ops`` uses."""
    return _framework_ops._colocate_with_for_gradient(op, uid)


def original_op_scope(graph: tf.Graph, op: tf.Operation):
    """``Graph._original_op``: ops made inside record ``op`` as the one they stand for."""
    return graph._original_op(op)


def set_graph_control_flow_context(graph: tf.Graph, context) -> None:
    """Set the control-flow context of the ops ``graph`` makes next (*rewrite.py only*)."""
    graph._set_control_flow_context(context)


def create_op(graph: tf.Graph, op_type: str, inputs: list, **kwargs) -> tf.Operation:
    """``Graph._create_op_internal``: a new op from exact inputs, dtypes, attrs and OpDef
    (*rewrite.py only*)."""
    return graph._create_op_internal(op_type, inputs, **kwargs)


def update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
    """``Operation._update_input``: ``op`` reads ``tensor`` as its input ``index``
    (*rewrite.py only*)."""
    op._update_input(index, tensor)


def set_op_device(op: tf.Operation, device) -> None:
    """``Operation._set_device`` (*rewrite.py only*)."""
    op._set_device(device)


def add_control_inputs(op: tf.Operation, ops: list) -> None:
    """``Operation._add_control_inputs``, without marking the waited-for ops
    (*rewrite.py only*)."""
    op._add_control_inputs(ops)


def preserve_from_grappler(op: tf.Operation) -> None:
    """Sets ``_grappler_do_not_remove`` on ``op``: grappler keeps it as built (its
    arithmetic optimizer does not fold an ``AddN`` so marked into a later sum)
    (*rewrite.py only*)."""
    op._set_attr("_grappler_do_not_remove", _attr_value_pb2.AttrValue(b=True))


# -- variables ------------------------------------------------------------------------


def is_resource_variable(value) -> bool:
    """Whether TensorFlow treats ``value`` as a resource variable (``tf.Variable``, Keras
    variables, ``AutoCastVariable``, distributed variables)."""
    return _resource_variable_ops.is_resource_variable(value)


def reference_variable_tensor(value):
    """The ref-typed tensor of a v1 reference variable (``use_resource=False``, TF1's
    default ``get_variable``): what ``tf.gradients`` differentiates with respect to for
    it (``as_ref``); None for anything else."""
    if isinstance(value, tf.Variable) and not is_resource_variable(value) and hasattr(
            value, "_ref"):
        return value._ref()
    return None


# -- GradientTape internals ---------------------------------------------------------------

#: The class every ``tf.GradientTape`` name and subclass shares.
GRADIENT_TAPE = _backprop.GradientTape


def tape_is_used_up(tape) -> bool:
    """Whether a tape has given its one gradient (non-persistent) and holds no record."""
    return tape._tape is None


def recorded_by_an_outer_differentiator(tensors: list) -> tuple:
    """``(by a tape, by a forward accumulator)``: whether a ``tf.GradientTape`` that is
    recording now watches any of ``tensors`` (``record.should_record_backprop``), and
    whether a ``tf.autodiff.ForwardAccumulator`` carries a tangent of any
    (``TFE_Py_PackJVPs``).  Then the ops that compute their gradients are themselves
    differentiated (a Hessian-vector product, a gradient penalty, forward over reverse)."""
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import record

    if not could_record():
        return False, False
    tensors = [t for t in tensors if isinstance(t, tf.Tensor)]
    if not tensors:
        return False, False
    return (bool(record.should_record_backprop(tensors)),
            bool(pywrap_tfe.TFE_Py_PackJVPs(tensors)[1]))


def could_record() -> bool:
    """Whether any tape or forward accumulator may be recording now (cheap)."""
    from tensorflow.python.eager import record

    return bool(record.could_possibly_record())


def record_for_tapes(op_type: str, outputs: list, inputs: list,
                     backward: typing.Callable) -> None:
    """Record one operation from ``inputs`` to ``outputs`` on every ``tf.GradientTape``
    recording now (not on forward accumulators), whose gradient is ``backward(*output
    gradients)``: one gradient (or None) per input (``record_operation_backprop_only``)."""
    from tensorflow.python.eager import record

    record.record_operation_backprop_only(op_type, outputs, inputs, backward)


def tape_is_recording(tape) -> bool:
    """Whether ``tape`` is inside its ``with`` block and not under ``stop_recording``."""
    return tape._recording


def tape_is_persistent(tape) -> bool:
    """``tape``'s ``persistent=`` argument."""
    return tape._persistent


def stop_tape(tape) -> None:
    """End ``tape``'s recording as leaving its ``with`` block does (``_pop_tape``)."""
    tape._pop_tape()


def release_tape(tape) -> None:
    """Use up a non-persistent tape as its ``gradient()`` does: keep its watched
    variables, drop its record."""
    tape._watched_variables = tape._tape.watched_variables()
    tape._tape = None


# -- tf.function internals (recovery after a failed first trace) -----------------------------


def _first_trace_code():
    try:
        from tensorflow.python.eager.polymorphic_function import (
            polymorphic_function as _polymorphic_function,
        )

        return _polymorphic_function.Function._initialize.__code__
    except (ImportError, AttributeError):  # pragma: no cover  (another TensorFlow layout)
        return None


#: Code object of ``tf.function``'s first-trace method (``Function._initialize``), or None.
FIRST_TRACE_CODE = _first_trace_code()


def function_first_trace_done(function) -> bool:
    """Whether a ``tf.function``'s first trace completed."""
    return getattr(function, "_concrete_variable_creation_fn", None) is not None


def function_created_variables(function) -> list:
    """Weak references to the variables a ``tf.function``'s first trace created."""
    return getattr(function, "_created_variables", None) or []


def forget_first_trace(function) -> None:
    """Set a ``tf.function`` whose first trace failed back to never traced."""
    function._created_variables = None
    function._variable_creation_config = None
    function._no_variable_creation_config = None


# -- tf.function calls (for messages only) -------------------------------------------------------


def _atomic_function_class():
    try:
        from tensorflow.python.eager.polymorphic_function import atomic_function
    except ImportError:  # pragma: no cover  (another TensorFlow layout)
        return None
    cls = getattr(atomic_function, "AtomicFunction", None)
    return cls if callable(getattr(cls, "call_flat", None)) else None


_ATOMIC_FUNCTION = _atomic_function_class()
_logger = logging.getLogger("memory_saving_gradients")
_call_observers: list = []
_call_observers_lock = threading.Lock()


def _observed_call_flat(call_flat):
    def observed(self, *args):
        observers = tuple(_call_observers)
        if observers and tf.executing_eagerly():
            graph = getattr(self, "_cached_graph", None)
            if graph is not None:
                for observer in observers:
                    try:
                        observer(graph)
                    except Exception:  # a message's bookkeeping never fails a step
                        _logger.debug("function call observer failed", exc_info=True)
        return call_flat(self, *args)

    observed._memory_saving_gradients_wraps = call_flat
    return observed


def observes_function_calls() -> bool:
    """Whether :func:`observe_function_calls` can see runs in this TensorFlow."""
    return _ATOMIC_FUNCTION is not None


def observe_function_calls(observer: typing.Callable) -> typing.Callable[[], None]:
    """Call ``observer(graph)`` with the traced graph (a ``FuncGraph``) of every
    ``tf.function`` that runs eagerly from now on (a call inside another function's
    trace is not a run); returns the function that stops it.  Where TensorFlow's
    layout is not the known one, nothing is observed."""
    if _ATOMIC_FUNCTION is None:  # pragma: no cover  (another TensorFlow layout)
        return lambda: None
    with _call_observers_lock:
        if not _call_observers:
            _ATOMIC_FUNCTION.call_flat = _observed_call_flat(_ATOMIC_FUNCTION.call_flat)
        _call_observers.append(observer)

    def stop() -> None:
        with _call_observers_lock:
            if observer not in _call_observers:
                return
            _call_observers.remove(observer)
            wrapped = _ATOMIC_FUNCTION.call_flat
            if not _call_observers and hasattr(wrapped, "_memory_saving_gradients_wraps"):
                _ATOMIC_FUNCTION.call_flat = wrapped._memory_saving_gradients_wraps

    return stop


# -- devices and kernels ----------------------------------------------------------------------


def gpu_visible() -> bool:
    """Whether TensorFlow sees a GPU in this process."""
    return bool(tf.config.list_physical_devices("GPU"))


def gpu_memory_limits() -> list:
    """The ``memory_limit`` (bytes) TensorFlow's allocator has on each local GPU, in order."""
    return [int(d.memory_limit) for d in _device_lib.list_local_devices()
            if d.device_type == "GPU"]


def onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN CPU kernels are on in this process.

    TensorFlow decides at import, from ``TF_ENABLE_ONEDNN_OPTS`` or, when it is
    unset, from the CPU (by TensorFlow's documentation on by default with
    AVX-512 VNNI/BF16 or AMX; seen off on an AVX2-only AMD EPYC).  True when
    TensorFlow does not say (other builds).
    """
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:  # pragma: no cover - builds without the probe
        return True
    probe = getattr(_pywrap_util_port, "IsMklEnabled", None)
    return True if probe is None else bool(probe())


# -- where patching finds TensorFlow's gradients ------------------------------------------------

#: Importable modules whose ``gradients`` attribute TensorFlow's own code calls (not
#: reached from ``tf``): ``tf.compat.v1.train.Optimizer.compute_gradients`` calls
#: ``gradients.gradients`` of this module, with the v1 signature.
PRIVATE_GRADIENT_SLOTS = (("tensorflow.python.ops.gradients", "gradients", "v1"),)


def defines_tf_gradients(module) -> bool:
    """Whether ``module`` is the one that defines TensorFlow's ``gradients`` functions."""
    return module is _gradients_impl


__all__ = [name for name in dir() if not name.startswith("_") and name not in (
    "annotations", "logging", "re", "warnings", "notices")]

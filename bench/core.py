"""The measuring core: one model, one way of computing gradients, measured.

``measure(model, variant)`` builds the model in a fresh ``tf.Graph``,
computes its gradients the way ``variant`` says, and runs the step in a
``tf.compat.v1.Session``:

- peak memory: the second of two fully traced runs
  (:func:`memory_saving_gradients.profiling.traced_run`), the peak of the
  running sum of the allocation records of the measured device's allocators;
- time: the median of ``steps`` untraced runs after those;
- rewrite time: the seconds spent building the gradient graph;
- predicted peak: :func:`memory_saving_gradients.plan`'s prediction, for
  the variants that the planner describes;
- gradients equal: the variant's gradients against TensorFlow's own
  ``tf.compat.v1.gradients`` of the same loss, same weights, same feed,
  computed in the same graph (in a second session with the default config
  when the variant's config differs).

A model is a :class:`ModelSpec`, or any function ``build(**kw) -> model``
that builds a model in the current (v1) default graph and returns an object
with ``.loss`` (scalar tensor), ``.params`` (variables or tensors to
differentiate) and ``.feed_dict`` (may be empty).  The ``'collection'``
variant calls ``build(add_to_collection=True)``; the ``'recompute_grad'`` and
``'tf.function'`` variants need a :class:`Functional` description (see
:func:`spec_from_module`), because ``tf.recompute_grad`` wraps Python
functions, not graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import statistics
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import numpy as np

from memory_saving_gradients import profiling
from memory_saving_gradients._tensorflow import tf, tf_gradients
from memory_saving_gradients._units import MIB

logger = logging.getLogger("bench")

#: Traced steps measured per variant (after one warm-up).  The executor's inter-op
#: threads order independent ops differently from run to run, and with them the
#: peak (plain tf.gradients on the U-Net: 49.6-65.3 MB).  The least is the peak of
#: the best order, the one plan() models; the most is reported beside it.
PEAK_RUNS = 3
#: A gradient check that fails is run again (both sides) up to this many times; the
#: table notes each retry.  A wrong rewrite fails every time.
GRADIENT_RETRIES = 2

#: Every variant, in table order.  See :data:`VARIANT_HELP`.
VARIANTS = (
    "tf.gradients",
    "grappler-recompute",
    "tf.function",
    "recompute_grad",
    "collection",
    "speed",
    "memory",
    "memory+budget",
)

VARIANT_HELP = {
    "tf.gradients": "tf.compat.v1.gradients, default ConfigProto (the baseline)",
    "grappler-recompute": "tf.compat.v1.gradients with grappler's memory_optimization="
    "RECOMPUTATION_HEURISTICS",
    "tf.function": "tf.GradientTape in a tf.function (control for recompute_grad; "
    "traced in eager context, body run in the measuring session)",
    "recompute_grad": "tf.recompute_grad around every unit (residual unit / block), "
    "tf.GradientTape in a tf.function",
    "collection": "memory_saving_gradients.gradients, checkpoints='collection' "
    "(the model's unit outputs)",
    "speed": "memory_saving_gradients.gradients, checkpoints='speed'",
    "memory": "memory_saving_gradients.gradients, checkpoints='memory'",
    "memory+budget": "checkpoints='memory' with memory_budget = budget_fraction x "
    "plan().baseline_peak_bytes",
}

#: Variants that run memory_saving_gradients.gradients, and their strategy.
LIBRARY_STRATEGY = {
    "collection": "collection",
    "speed": "speed",
    "memory": "memory",
    "memory+budget": "memory",
}

#: Variants traced as a tf.function in eager context, and their unit wrapper.
FUNCTION_VARIANTS = ("tf.function", "recompute_grad")

DEFAULT_BUDGET_FRACTION = 0.22


@dataclasses.dataclass
class Functional:
    """A model as functions, for variants that trace it in a ``tf.function``.

    ``make_params()`` creates the variables (eagerly) and returns an object
    whose ``.trainable`` (or itself, if it is a list) lists the variables to
    differentiate, in the same order as the v1 build's ``params``.
    ``forward(params, *inputs, unit_wrapper=...)`` returns the loss or
    ``(loss, ...)``.  ``input_signature`` and ``inputs`` (numpy arrays) give
    the inputs, in the same order as the v1 build's placeholders are fed.
    """

    make_params: Callable[[], Any]
    forward: Callable[..., Any]
    input_signature: Sequence[Any]
    inputs: Sequence[np.ndarray]


@dataclasses.dataclass
class ModelSpec:
    """What :func:`measure` needs to build one model of one size."""

    name: str
    build: Callable[..., Any]
    functional: Optional[Functional] = None
    size: dict = dataclasses.field(default_factory=dict)

    @property
    def size_label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.size.items() if k != "batch")

    @property
    def batch(self):
        return self.size.get("batch", "")


@dataclasses.dataclass
class Result:
    """One measured (model, variant)."""

    model: str
    size: str
    batch: Any
    variant: str
    peak_bytes: Optional[int] = None  # the least of PEAK_RUNS traced steps
    peak_max_bytes: Optional[int] = None  # the most of them
    median_step_seconds: Optional[float] = None
    median_step_cpu_seconds: Optional[float] = None  # CPU seconds of this process per step
    step_spread: Optional[float] = None  # interquartile range of the step's wall seconds / median
    cpu_spread: Optional[float] = None  # the same for its CPU seconds (see relative_spread)
    rewrite_seconds: Optional[float] = None
    predicted_peak_bytes: Optional[int] = None
    predicted_time_ratio: Optional[float] = None  # plan()'s step time over tf.gradients'
    grads_equal: Optional[bool] = None
    max_grad_diff: Optional[float] = None
    allocators: str = ""
    budget_bytes: Optional[int] = None
    baseline_predicted_bytes: Optional[int] = None
    plan_key: Optional[str] = None  # the planned checkpoints' names, hashed: equal plans
    gradient_retries: int = 0  # gradient checks repeated after a mismatch (see GRADIENT_RETRIES)
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.peak_bytes is not None

    @property
    def peak_mb(self) -> Optional[float]:
        return None if self.peak_bytes is None else self.peak_bytes / MIB


def spec_from_module(module, seed: int = 0, name: Optional[str] = None, **size) -> ModelSpec:
    """A :class:`ModelSpec` for a module with the ``test_models`` interface.

    The module has ``build(seed, add_to_collection, unit_wrapper, **size)``,
    ``make_params``, ``forward``, ``input_signature`` and ``make_inputs``.
    """

    def build(**kw):
        return module.build(seed=seed, **size, **kw)

    def make_params():
        return module.make_params(seed=seed, **size)

    def forward(params, *inputs, unit_wrapper=None):
        return module.forward(params, *inputs, unit_wrapper=unit_wrapper, training=True)

    functional = Functional(
        make_params=make_params,
        forward=forward,
        input_signature=module.input_signature(**size),
        inputs=module.make_inputs(seed=seed, **size),
    )
    label = name or getattr(module, "NAME", module.__name__.rsplit(".", 1)[-1])
    return ModelSpec(name=label, build=build, functional=functional, size=dict(size))


def as_spec(model) -> ModelSpec:
    """A ModelSpec from a ModelSpec or a plain build function."""
    if isinstance(model, ModelSpec):
        return model
    if callable(model):
        return ModelSpec(name=getattr(model, "__name__", "model"), build=model)
    raise TypeError(
        f"model must be a ModelSpec or a function that builds the model in the "
        f"default graph; got {type(model).__name__}."
    )


def default_config() -> "tf.compat.v1.ConfigProto":
    """TensorFlow's default session config (grappler on), as users run."""
    return tf.compat.v1.ConfigProto()


def grappler_recompute_config(base=None) -> "tf.compat.v1.ConfigProto":
    """``base`` (default config) with grappler's RECOMPUTATION_HEURISTICS memory optimizer."""
    from tensorflow.core.protobuf import rewriter_config_pb2

    config = tf.compat.v1.ConfigProto()
    if base is not None:
        config.CopyFrom(base)
    config.graph_options.rewrite_options.memory_optimization = (
        rewriter_config_pb2.RewriterConfig.RECOMPUTATION_HEURISTICS
    )
    return config


def library_available(variant: str) -> Optional[str]:
    """None if the variant can run with this installation, else why not."""
    if variant not in VARIANTS:
        return f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}"
    if variant in FUNCTION_VARIANTS and not tf.executing_eagerly():
        return "needs eager execution enabled (the TF2 default) to trace the tf.function"
    return None


def peak_bytes(run_metadata, device: str = "") -> tuple:
    """(peak bytes, allocator names) of a traced step on the CPU or on the GPU.

    With a GPU ``device`` the GPU allocators count (e.g. ``'GPU_0_bfc'``);
    otherwise every other allocator but CUDA's host allocators.  Records of
    the chosen allocators are merged before the running sum, so two
    allocators of one device are not double counted at different times.
    """
    records = profiling.allocation_records(run_metadata)
    on_gpu = "gpu" in device.lower()
    chosen = sorted(
        name
        for name in records
        if ("gpu" in name.lower()) == on_gpu and "cuda_host" not in name.lower()
    )
    return profiling.running_peak(r for name in chosen for r in records[name]), chosen


def gradients_close(values, reference, rtol: float = 1e-3) -> tuple:
    """(all equal, largest difference relative to the reference's magnitude).

    Sparse values (``IndexedSlicesValue``) are densified first.  A gradient
    counts as equal when ``max|a - b| <= rtol * max|b|`` (float32 noise of a
    different summation order is far below that; a wrong gradient is not).
    """
    worst = 0.0
    equal = len(values) == len(reference)
    for a, b in zip(values, reference):
        if (a is None) != (b is None):
            return False, float("inf")
        if a is None:
            continue
        a, b = _dense(a), _dense(b)
        if a.shape != b.shape:
            return False, float("inf")
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        diff = float(np.max(np.abs(a.astype(np.float64) - b))) if b.size else 0.0
        relative = diff / scale if scale > 0 else diff
        worst = max(worst, relative)
        if not np.all(np.isfinite(a)) or relative > rtol:
            equal = False
    return equal, worst


def _dense(value) -> np.ndarray:
    if hasattr(value, "indices") and hasattr(value, "values"):
        shape = tuple(int(d) for d in value.dense_shape)
        out = np.zeros(shape, dtype=np.float64)
        np.add.at(out, np.asarray(value.indices), np.asarray(value.values, dtype=np.float64))
        return out
    return np.asarray(value, dtype=np.float64)


def measure(
    model,
    variant: str,
    config=None,
    steps: int = 5,
    budget_fraction: float = DEFAULT_BUDGET_FRACTION,
    check_grads: bool = True,
    device: str = "",
    seed: int = 0,
) -> Result:
    """Measure one model with one variant; see the module docstring.

    Args:
      model: a :class:`ModelSpec` or a build function (module docstring).
      variant: one of :data:`VARIANTS`.
      config: session ConfigProto (default: TensorFlow's default).  The
        'grappler-recompute' variant adds its memory optimizer to it.
      steps: untraced steps to time (0: no timing).
      budget_fraction: for 'memory+budget', the budget as a fraction of the
        planner's predicted ``tf.gradients`` peak.
      check_grads: compare the gradients with ``tf.compat.v1.gradients``.
      device: a TensorFlow device (``'/GPU:0'``) to build on; also picks the
        allocators whose peak counts.  Empty: the default placement, CPU peaks.
      seed: graph-level random seed.

    Returns:
      A :class:`Result`.  A variant that fails to build or run (e.g. an
      infeasible budget) returns a Result with ``error`` set; nothing raises
      except bad arguments.
    """
    prepared = prepare(model, variant, config, budget_fraction, check_grads, device, seed)
    try:
        time_interleaved([prepared], steps)
    finally:
        prepared.close()
    return prepared.result


class Prepared:
    """A variant built, its session open, its peak measured and gradients checked.

    :func:`time_interleaved` then times steps of several prepared variants in
    turn, so that a change of machine load affects all of them alike.
    """

    def __init__(self, result: Result, session=None, fetches=None, feed=None):
        self.result = result
        self._session = session
        self._fetches = fetches
        self._feed = feed
        self.times: list = []
        self.cpu_times: list = []

    @property
    def ready(self) -> bool:
        return self._session is not None

    def step(self, record: bool = True) -> float:
        """Run one untraced step; return (and record, unless told not to) its seconds."""
        cpu_start = time.process_time()
        start = time.perf_counter()
        self._session.run(self._fetches, self._feed)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        if not record:
            return elapsed
        self.times.append(elapsed)
        self.cpu_times.append(cpu)
        self.result.median_step_seconds = statistics.median(self.times)
        self.result.median_step_cpu_seconds = statistics.median(self.cpu_times)
        self.result.step_spread = relative_spread(self.times)
        self.result.cpu_spread = relative_spread(self.cpu_times)
        return elapsed

    def traced_step(self):
        """Run one fully traced step (not recorded as a timed step); its RunMetadata and seconds."""
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        metadata = tf.compat.v1.RunMetadata()
        start = time.perf_counter()
        self._session.run(self._fetches, self._feed, options=options, run_metadata=metadata)
        return metadata, time.perf_counter() - start

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
        self._session = self._fetches = self._feed = None
        gc.collect()


def relative_spread(values: Sequence[float]) -> Optional[float]:
    """The interquartile range of ``values`` over their median (None for under 4 values)."""
    if len(values) < 4:
        return None
    low, _, high = statistics.quantiles(values, n=4)
    median = statistics.median(values)
    return (high - low) / median if median > 0 else None


def time_interleaved(prepared: Sequence[Prepared], steps: int, warmup: int = 1) -> None:
    """``warmup`` untimed rounds, then ``steps`` timed rounds, each running one step
    of every ready variant in turn."""
    for round_index in range(max(0, warmup) + max(0, steps)):
        for p in prepared:
            if p.ready:
                p.step(record=round_index >= warmup)


def prepare(
    model,
    variant: str,
    config=None,
    budget_fraction: float = DEFAULT_BUDGET_FRACTION,
    check_grads: bool = True,
    device: str = "",
    seed: int = 0,
    predict: bool = True,
    budget_bytes: Optional[int] = None,
) -> Prepared:
    """Build, trace (peak) and check one variant, leaving its session open for timing.

    Arguments as :func:`measure`; ``predict=False`` skips ``plan()``'s
    prediction (a second run of the strategy's search); ``budget_bytes``
    gives ``memory+budget`` its budget in bytes instead of ``budget_fraction``.
    Call ``.close()`` on the result.
    """
    spec = as_spec(model)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")
    result = Result(model=spec.name, size=spec.size_label, batch=spec.batch, variant=variant)
    why_not = library_available(variant)
    if why_not:
        result.error = "skipped: " + why_not
        return Prepared(result)
    if variant in FUNCTION_VARIANTS and spec.functional is None:
        result.error = (
            "skipped: needs a Functional description of the model (see spec_from_module)"
        )
        return Prepared(result)
    base_config = config if config is not None else default_config()
    run_config = (
        grappler_recompute_config(base_config) if variant == "grappler-recompute" else base_config
    )
    session = None
    try:
        if variant in FUNCTION_VARIANTS:
            built = _build_function_variant(spec, variant, device, seed, check_grads)
        else:
            built = _build_graph_variant(spec, variant, device, seed, budget_fraction, check_grads,
                                         result, predict, budget_bytes)
        session = tf.compat.v1.Session(graph=built.graph, config=run_config)
        _trace_and_check(built, session, result, run_config, base_config, device, check_grads)
        return Prepared(result, session, built.fetches, built.feed)
    except Exception as error:  # a variant that cannot run is a row, not a crash
        logger.debug("variant %s on %s failed", variant, spec.name, exc_info=True)
        result.error = f"{type(error).__name__}: {_first_line(error)}"
        if session is not None:
            session.close()
        gc.collect()
        return Prepared(result)


@dataclasses.dataclass
class _Built:
    graph: Any
    fetches: list          # [loss] + gradients, run by the measured step
    feed: dict
    reference: Optional[list]  # tf.compat.v1.gradients of the same loss (None: same as fetches)
    reference_feed: dict
    rewrite_seconds: float


def _xs_of(model) -> list:
    xs = list(getattr(model, "params", None) or [])
    if not xs:
        xs = list(getattr(model, "inputs", None) or [])
    if not xs:
        raise ValueError("the model has neither params nor inputs to differentiate")
    return xs


def _device_scope(device: str):
    import contextlib

    return tf.device(device) if device else contextlib.nullcontext()


def _build_graph_variant(spec, variant, device, seed, budget_fraction, check_grads, result,
                         predict=True, budget_bytes=None):
    import memory_saving_gradients as msg

    graph = tf.Graph()
    with graph.as_default(), _device_scope(device):
        tf.compat.v1.set_random_seed(seed)
        kwargs = {"add_to_collection": True} if variant == "collection" else {}
        model = spec.build(**kwargs)
        loss, xs = model.loss, _xs_of(model)
        feed = dict(getattr(model, "feed_dict", None) or {})
        strategy = LIBRARY_STRATEGY.get(variant)
        budget = None
        if variant == "memory+budget":
            budget = budget_bytes or int(budget_fraction * _baseline_prediction(msg, loss, xs))
            result.budget_bytes = budget
        if predict and strategy is not None:
            the_plan = msg.plan(loss, xs, checkpoints=strategy, memory_budget=budget)
            result.predicted_peak_bytes = int(the_plan.predicted_peak_bytes)
            result.baseline_predicted_bytes = int(the_plan.baseline_peak_bytes)
            result.plan_key = _plan_key(the_plan.checkpoints)
            result.predicted_time_ratio = float(the_plan.predicted_step_ratio)
        elif predict:
            try:
                result.baseline_predicted_bytes = _baseline_prediction(msg, loss, xs)
                if variant == "tf.gradients":
                    result.predicted_peak_bytes = result.baseline_predicted_bytes
            except Exception:  # the planner is optional for the baselines
                logger.debug("plan() failed for the baseline", exc_info=True)
        gc.collect()  # so that no earlier variant's garbage is collected inside the timing
        start = time.perf_counter()
        if strategy is None:
            grads = tf_gradients(loss, xs)
        else:
            grads = msg.gradients(loss, xs, checkpoints=strategy, memory_budget=budget)
        rewrite_seconds = time.perf_counter() - start
        reference = None
        if check_grads and strategy is not None:
            reference = tf_gradients(loss, xs)
    return _Built(graph, [loss] + list(grads), feed, reference, feed, rewrite_seconds)


def _plan_key(checkpoints) -> str:
    """Names of the checkpoints, sorted and hashed: the same key, the same plan."""
    names = "\n".join(sorted(t.name for t in checkpoints))
    return hashlib.sha1(names.encode()).hexdigest()[:12]


def _baseline_prediction(msg, loss, xs) -> int:
    """plan()'s predicted peak for plain tf.gradients, without running a strategy's search.

    The baseline prediction does not depend on the checkpoints; the
    collection (usually empty here) is the cheapest plan to ask for.  Its
    "nothing to keep" warning is not news here, so it is silenced.
    """
    library_logger = logging.getLogger("memory_saving_gradients")
    level = library_logger.level
    library_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", msg.NothingKeptWarning)
            return int(msg.plan(loss, xs, checkpoints="collection").baseline_peak_bytes)
    finally:
        library_logger.setLevel(level)


def _build_function_variant(spec, variant, device, seed, check_grads):
    """Trace the train step as a tf.function in eager context; import its body.

    ``tf.recompute_grad`` orders its recomputation after the incoming gradient
    through a data dependency built with ``Tensor.__eq__``; in a function
    traced inside a v1 graph that comparison falls back to Python identity,
    the dependency disappears and the recomputation runs during the forward
    pass (measured: no saving at all).  Traced in eager context, as TF2 users
    call it, it works.  The traced body (forward and backward, no function
    call left) is imported into a fresh v1 graph whose variables hold the
    same values, and measured there like every other variant.
    """
    functional = spec.functional
    if tf.compat.v1.executing_eagerly_outside_functions() is False:
        raise RuntimeError("tracing needs eager execution outside functions")
    with tf.init_scope():
        params = functional.make_params()
    xs_vars = list(getattr(params, "trainable", params) or [])
    wrapper = tf.recompute_grad if variant == "recompute_grad" else None
    timing = {}

    def step(*inputs):
        with tf.GradientTape() as tape:
            xs = xs_vars or list(inputs)
            if not xs_vars:
                for x in inputs:
                    tape.watch(x)
            out = functional.forward(params, *inputs, unit_wrapper=wrapper)
            loss = out[0] if isinstance(out, (tuple, list)) else out
        start = time.perf_counter()
        grads = tape.gradient(loss, xs)
        timing["rewrite"] = time.perf_counter() - start
        return [loss] + list(grads)

    with _device_scope(device):
        function = tf.function(step, input_signature=list(functional.input_signature),
                               autograph=False)
        concrete = function.get_concrete_function()
    func_graph = concrete.graph
    structured = concrete.structured_outputs
    flat = tf.nest.flatten(structured, expand_composites=True)

    by_handle = {}
    for v in list(func_graph.variables) + xs_vars:
        by_handle[id(v.handle)] = v
    captured = []  # (inner placeholder name, name or None, value), read eagerly
    for outer, inner in zip(concrete.captured_inputs, func_graph.internal_captures):
        variable = by_handle.get(id(outer))
        if variable is not None:
            captured.append((inner.name, variable.name.split(":")[0], variable.numpy()))
        else:
            captured.append((inner.name, None, outer.numpy()))
    graph = tf.Graph()
    with graph.as_default(), _device_scope(device):
        tf.compat.v1.set_random_seed(seed)
        placeholders = [
            tf.compat.v1.placeholder(s.dtype, s.shape, name=(s.name or f"input_{i}"))
            for i, s in enumerate(functional.input_signature)
        ]
        input_map = {
            inner.name: ph for inner, ph in zip(func_graph.inputs, placeholders)
        }
        for inner_name, variable_name, value in captured:
            if variable_name is not None:
                input_map[inner_name] = tf.Variable(value, name=variable_name).handle
            else:
                input_map[inner_name] = tf.constant(value)
        names = [t.name for t in flat if t is not None]
        imported = iter(tf.graph_util.import_graph_def(
            func_graph.as_graph_def(), input_map=input_map, return_elements=names, name="step"
        ))
        flat_imported = [None if t is None else next(imported) for t in flat]
        fetches = tf.nest.pack_sequence_as(structured, flat_imported, expand_composites=True)
        feed = dict(zip(placeholders, functional.inputs))
        reference, reference_feed = None, {}
        if check_grads:
            ref_model = spec.build()
            reference = tf_gradients(ref_model.loss, _xs_of(ref_model))
            reference_feed = dict(getattr(ref_model, "feed_dict", None) or {})
    return _Built(graph, list(fetches), feed, reference, reference_feed, timing.get("rewrite", 0.0))


def _trace_and_check(built, session, result, run_config, base_config, device, check_grads):
    result.rewrite_seconds = built.rewrite_seconds
    with built.graph.as_default():
        init = tf.compat.v1.global_variables_initializer()
    session.run(init)
    values, metadata = profiling.traced_run(session, built.fetches, built.feed, runs=2)
    peaks = [peak_bytes(metadata, device)]
    for _ in range(PEAK_RUNS - 1):
        _, metadata = profiling.traced_run(session, built.fetches, built.feed, runs=1)
        peaks.append(peak_bytes(metadata, device))
    result.peak_bytes, allocators = min(peaks, key=lambda p: p[0])
    result.peak_max_bytes = max(p[0] for p in peaks)
    result.allocators = ",".join(allocators)
    if not check_grads:
        return
    if built.reference is None and result.variant == "tf.gradients":
        result.grads_equal, result.max_grad_diff = True, 0.0
        return
    if built.reference is None:  # same tensors, another config: run them in a default session
        reference_tensors, reference_feed = built.fetches[1:], built.feed
    else:
        reference_tensors, reference_feed = built.reference, built.reference_feed
    with contextlib.ExitStack() as stack:
        other = session
        if run_config is not base_config:
            other = stack.enter_context(
                tf.compat.v1.Session(graph=built.graph, config=base_config))
            other.run(init)
        # one run where it can: a random op (dropout) draws once for both, where two
        # runs draw two masks and the gradients differ by the masks, not the rewrite
        together = other is session and reference_feed is built.feed

        def run_both():
            if together:
                return session.run([built.fetches, reference_tensors], built.feed)
            return (session.run(built.fetches, built.feed),
                    other.run(reference_tensors, reference_feed))

        if together:
            values, reference = run_both()
        else:  # the traced run's values
            reference = other.run(reference_tensors, reference_feed)
        result.grads_equal, result.max_grad_diff = gradients_close(values[1:], reference)
        for _ in range(GRADIENT_RETRIES):
            if result.grads_equal:
                break
            # oneDNN's CPU kernels are not always deterministic: plain tf.gradients on a
            # ResNet-14 (width 4, batch 2) gave a wrong filter gradient in 1 of 30 runs
            # of one graph.  A wrong rewrite differs every time; a race does not.
            result.gradient_retries += 1
            values, reference = run_both()
            result.grads_equal, result.max_grad_diff = gradients_close(values[1:], reference)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""

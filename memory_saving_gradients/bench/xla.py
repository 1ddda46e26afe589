"""XLA's own memory for one training step: plain vs recomputation, under ``jit_compile``.

XLA allocates one preallocated temporary buffer per compiled computation
(its buffer assignment packs every intermediate into it), which no
TensorFlow allocator record shows.  Its size is in the memory-usage report
that ``--xla_dump_to`` writes; :class:`XlaDump` switches that dump on (it
must be set before the process compiles anything with XLA) and reads back
the reports of each new compilation.

``measure_xla(module, size, variants)`` builds a ``test_models``-style
model eagerly (variables outside the step), compiles one gradient step per
variant with ``tf.function(jit_compile=True)`` and returns, per variant, XLA
temp bytes, median step time, gradient error against ``tf.gradients``
without XLA, and, for the library's variants, ``plan()``'s predicted peak.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import statistics
import tempfile
import time
from typing import Optional, Sequence

import numpy as np

from .._tensorflow import tf, tf_gradients

logger = logging.getLogger("memory_saving_gradients.bench")

#: Variants of the XLA comparison, in table order.
XLA_VARIANTS = ("tf.gradients", "recompute_grad", "collection", "memory")

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def temp_bytes_of_report(text: str) -> int:
    """The preallocated temp bytes of one XLA memory-usage report (0 if none)."""
    sizes = [int(m) for m in re.findall(r"allocation \d+: size (\d+), preallocated-temp", text)]
    sizes += [
        int(round(float(v) * _UNITS[u]))
        for v, u in re.findall(
            r"allocation \d+: size ([\d.]+)(B|KiB|MiB|GiB), preallocated-temp", text
        )
    ]
    return max(sizes, default=0)


class XlaDump:
    """Reads XLA's memory-usage reports of the computations compiled from now on.

    Adds ``--xla_dump_to`` to ``XLA_FLAGS`` (kept if one is already there):
    XLA reads the flags once, at its first compilation, so create this
    before anything in the process is compiled with XLA.
    """

    def __init__(self, directory: Optional[str] = None):
        flags = os.environ.get("XLA_FLAGS", "")
        match = re.search(r"--xla_dump_to=(\S+)", flags)
        if match:
            self.directory = match.group(1)
        else:
            self.directory = directory or tempfile.mkdtemp(prefix="msg_xla_dump_")
            os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={self.directory}".strip()
        os.makedirs(self.directory, exist_ok=True)
        self._seen = set(os.listdir(self.directory))

    def new_temp_bytes(self) -> list:
        """Temp bytes of each computation compiled since the last call, largest first."""
        files = set(os.listdir(self.directory))
        new = sorted(f for f in files - self._seen if f.endswith("memory-usage-report.txt"))
        self._seen = files
        sizes = []
        for name in new:
            with open(os.path.join(self.directory, name)) as f:
                sizes.append(temp_bytes_of_report(f.read()))
        return sorted(sizes, reverse=True)


@dataclasses.dataclass
class XlaResult:
    """One model x variant under ``tf.function(jit_compile=True)``."""

    model: str
    size: dict
    variant: str
    temp_bytes: int
    step_seconds: float
    max_rel_error: float
    max_rel_error_vs_xla: Optional[float] = None
    predicted_peak_bytes: Optional[int] = None
    baseline_predicted_bytes: Optional[int] = None


def gradient_step(module, params, variant: str, jit_compile: bool = True):
    """A ``tf.function`` returning the gradients of ``module.forward``'s loss by ``variant``."""
    import memory_saving_gradients as msg

    trainable = list(params.trainable)

    @tf.function(jit_compile=jit_compile, autograph=False)
    def step(*inputs):
        if variant == "recompute_grad":
            with tf.GradientTape() as tape:
                loss, _ = module.forward(params, *inputs, unit_wrapper=tf.recompute_grad)
            return tape.gradient(loss, trainable)
        loss, units = module.forward(params, *inputs)
        if variant == "tf.gradients":
            return tf_gradients(loss, trainable)
        if variant == "collection":
            return msg.gradients(loss, trainable, checkpoints=list(units))
        return msg.gradients(loss, trainable, checkpoints=variant)

    return step


def planned_peaks(module, params, inputs, strategy: str = "memory") -> tuple:
    """``plan()``'s predicted peak and plain baseline for the step, traced for XLA."""
    import memory_saving_gradients as msg

    trainable = list(params.trainable)
    box = {}

    @tf.function(jit_compile=True, autograph=False)
    def trace(*xs):
        loss, units = module.forward(params, *xs)
        plan = msg.plan(loss, trainable, checkpoints=list(units) if strategy == "collection"
                        else strategy)
        box["plan"] = plan
        return loss

    trace.get_concrete_function(*inputs)
    plan = box["plan"]
    return plan.predicted_peak_bytes, plan.baseline_peak_bytes


def measure_xla(
    module,
    size: dict,
    variants: Sequence[str] = XLA_VARIANTS,
    dump: Optional[XlaDump] = None,
    steps: int = 5,
    seed: int = 0,
    name: Optional[str] = None,
) -> list:
    """:class:`XlaResult` s of one model (a ``test_models`` module) at one size."""
    dump = dump or XlaDump()
    params = module.make_params(seed=seed, **size)
    inputs = [tf.constant(v) for v in module.make_inputs(seed=seed, **size)]
    reference = _values(gradient_step(module, params, "tf.gradients", False)(*inputs))
    results = []
    xla_plain = None
    for variant in variants:
        step = gradient_step(module, params, variant)
        dump.new_temp_bytes()
        grads = _values(step(*inputs))
        temps = dump.new_temp_bytes()
        if not temps:
            raise RuntimeError(f"XLA wrote no memory report for {variant}; is XLA_FLAGS set late?")
        times = []
        for _ in range(max(steps, 0)):
            start = time.perf_counter()
            out = step(*inputs)
            _values(out)
            times.append(time.perf_counter() - start)
        error = _max_rel_error(grads, reference)
        if variant == "tf.gradients":
            xla_plain = grads
        predicted = baseline = None
        if variant in ("memory", "collection"):
            predicted, baseline = planned_peaks(module, params, inputs, variant)
        results.append(XlaResult(
            model=name or module.__name__.rsplit(".", 1)[-1], size=dict(size), variant=variant,
            temp_bytes=temps[0], step_seconds=statistics.median(times) if times else float("nan"),
            max_rel_error=error,
            max_rel_error_vs_xla=None if xla_plain is None else _max_rel_error(grads, xla_plain),
            predicted_peak_bytes=predicted, baseline_predicted_bytes=baseline,
        ))
        logger.info("xla %s %s: temp %d B, %.4f s", results[-1].model, variant, temps[0],
                    results[-1].step_seconds)
    return results


def _values(gradients) -> list:
    """Numpy values of gradients, ``IndexedSlices`` made dense."""
    return [np.asarray(tf.convert_to_tensor(g)) for g in gradients]


def _max_rel_error(values, reference) -> float:
    """Largest absolute difference of each gradient, relative to its largest reference entry."""
    return max(
        (float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)
         for a, b in zip(values, reference) if b.size),
        default=0.0,
    )

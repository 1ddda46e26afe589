"""The time model: how long an op takes, from its FLOPs and bytes and per-kind throughputs.

Layer: foundation; imports: ops, _tensorflow (inside calibrate and machine_key).

The model is a pure function of numbers (:func:`op_seconds`); the throughputs
it uses come from :func:`calibrate`, which times a few kernels once on this
machine in a private graph and caches them, or from :data:`DEFAULT` until
then.  ``simulate.op_seconds`` prices each op with it: the planner weighs
recomputation in these seconds (``Sizer.cost``), so budgets and ``'balanced'``
pick the plan that recomputes least in time, and ``plan()`` predicts the
step-time ratio from them (``Plan.predicted_step_ratio``).

An op is ``max(flops / rate(kind), bytes / bandwidth) + seconds_per_op``: a
roofline with a fixed cost per kernel (the executor's scheduling, which a plan
that recomputes many tiny ops pays once per copy).  Its gradient costs
``backward_factor(kind)`` times as much.

The step-time prediction adds a cache term (the planner's cost does not): where
the memory model's replay finds that a kernel's bytes were touched recently (less
than the last-level cache, :func:`cache_bytes`, since), they cost
``cached_traffic_share`` of what they cost from memory (``traffic_share`` of
:func:`op_seconds`; see ``simulate.timed_seconds``).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import logging
import os
import platform
import threading
import time
from typing import Mapping, Optional

from . import ops as op_types

logger = logging.getLogger("memory_saving_gradients")

#: The kinds of op the model tells apart, and the op types of each (others are "other").
KIND_OP_TYPES: Mapping[str, frozenset] = {
    "conv": op_types.CONVOLUTIONS | frozenset({"_FusedConv2D"}),
    "matmul": op_types.MATRIX_PRODUCTS | frozenset({"_FusedMatMul"}),
    "norm": op_types.BATCH_NORMS,
}
KINDS = ("conv", "matmul", "norm", "other")


def kind_of(op_type: str) -> str:
    """The model's kind of an op type."""
    for kind, types in KIND_OP_TYPES.items():
        if op_type in types:
            return kind
    return "other"


#: :attr:`Throughput.cached_traffic_share` until calibrated: :func:`calibrate` measured
#: 0.41-0.56 on a 2-core AMD EPYC with 32 MiB of L3, and a 1 MiB ``TanhGrad`` that found
#: its three buffers in the cache took 0.55x the time of one that read its forward tensor
#: from memory (about 0.35); docs/results.md.
DEFAULT_CACHED_TRAFFIC_SHARE = 0.4


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What one kernel costs on a machine: FLOP rates per kind, memory bandwidth, a fixed cost.

    ``backward`` is the time of an op's gradient over the op's own, per kind.
    ``cached_traffic_share``: the time of a byte found in the last-level cache over
    one read from (or written to) memory.
    """

    flops_per_second: Mapping[str, float]
    bytes_per_second: float
    seconds_per_op: float
    backward: Mapping[str, float]
    source: str = "default"
    cached_traffic_share: float = DEFAULT_CACHED_TRAFFIC_SHARE

    def as_dict(self) -> dict:
        return dict(flops_per_second=dict(self.flops_per_second),
                    bytes_per_second=self.bytes_per_second, seconds_per_op=self.seconds_per_op,
                    backward=dict(self.backward), source=self.source,
                    cached_traffic_share=self.cached_traffic_share)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Throughput":
        return cls(dict(data["flops_per_second"]), float(data["bytes_per_second"]),
                   float(data["seconds_per_op"]), dict(data["backward"]),
                   str(data.get("source", "cache")),
                   float(data.get("cached_traffic_share", DEFAULT_CACHED_TRAFFIC_SHARE)))



#: Used until :func:`calibrate` has run on this machine: :func:`calibrate`'s figures on
#: a 2-core AMD EPYC (AVX-512, oneDNN on, TensorFlow 2.21), rounded.
DEFAULT = Throughput(
    flops_per_second={"conv": 40e9, "matmul": 60e9, "norm": 4e9, "other": 2e9},
    bytes_per_second=8e9,
    seconds_per_op=15e-6,
    backward={"conv": 2.0, "matmul": 2.0, "norm": 2.0, "other": 1.5},
)


def op_seconds(flops: float, traffic_bytes: float, kind: str, throughput: Throughput,
               traffic_share: float = 1.0) -> float:
    """Modelled seconds of one kernel that does ``flops`` and moves ``traffic_bytes``;
    ``traffic_share``: what its bytes cost over bytes from memory (less where some are
    in the cache)."""
    rate = throughput.flops_per_second.get(kind) or throughput.flops_per_second["other"]
    memory = traffic_share * traffic_bytes / throughput.bytes_per_second
    return max(flops / rate, memory) + throughput.seconds_per_op


def traffic_share(cached_bytes: float, uncached_bytes: float, throughput: Throughput) -> float:
    """What a kernel's bytes cost over bytes from memory, where ``cached_bytes`` of them
    are found in the cache (1.0 where it moves none)."""
    total = cached_bytes + uncached_bytes
    if not total:
        return 1.0
    return (uncached_bytes + throughput.cached_traffic_share * cached_bytes) / total


@functools.lru_cache(maxsize=1)
def cache_bytes() -> int:
    """This machine's last-level cache, in bytes (from sysfs; 0, no cache term, where
    it cannot be read).  ``$MSG_CACHE_BYTES`` overrides it."""
    stated = os.environ.get("MSG_CACHE_BYTES")
    if stated:
        return int(stated)
    largest = (0, 0)
    for folder in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(folder, "level"), encoding="utf-8") as handle:
                level = int(handle.read())
            with open(os.path.join(folder, "type"), encoding="utf-8") as handle:
                if handle.read().strip() == "Instruction":
                    continue
            with open(os.path.join(folder, "size"), encoding="utf-8") as handle:
                size = _parse_size(handle.read().strip())
        except (OSError, ValueError):
            continue
        largest = max(largest, (level, size))
    return largest[1]


def _parse_size(text: str) -> int:
    """sysfs's cache size ("32768K", "2M") in bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def backward_seconds(forward_seconds: float, kind: str, throughput: Throughput) -> float:
    """Modelled seconds of the gradient of an op that takes ``forward_seconds``."""
    return forward_seconds * throughput.backward.get(kind, throughput.backward["other"])


# -- calibration -------------------------------------------------------------------------

_lock = threading.Lock()
_current: Optional[Throughput] = None


def cache_path() -> str:
    """Where calibrations are kept: ``$MSG_CACHE_DIR`` or ``~/.cache/memory_saving_gradients``."""
    folder = os.environ.get("MSG_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "memory_saving_gradients")
    return os.path.join(folder, "throughput.json")


def machine_key() -> str:
    """What a calibration holds for: CPU model, cores, TensorFlow version, oneDNN."""
    from ._tensorflow import onednn_enabled, tf

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu} | {os.cpu_count()} cores | tf {tf.__version__} | onednn {onednn_enabled()}"


def current() -> Throughput:
    """This machine's cached calibration, or :data:`DEFAULT` (never calibrates by itself)."""
    global _current
    with _lock:
        if _current is None:
            _current = _load(machine_key()) or DEFAULT
        return _current


def _load(key: str) -> Optional[Throughput]:
    try:
        with open(cache_path(), encoding="utf-8") as handle:
            entry = json.load(handle).get(key)
        return Throughput.from_dict(entry) if entry else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save(key: str, throughput: Throughput) -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path, encoding="utf-8") as handle:
                entries = json.load(handle)
        except (OSError, ValueError):
            entries = {}
        entries[key] = throughput.as_dict()
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(entries, handle, indent=1)
        os.replace(path + ".tmp", path)
    except OSError as error:  # a read-only home: the calibration lives for this process
        logger.info("could not cache the time model's calibration at %s: %s", path, error)


def calibrate(force: bool = False, repeats: int = 5) -> Throughput:
    """Time a convolution, a matmul, a batch norm, an elementwise op and a chain of tiny ops
    (forward and gradient) on this machine's CPU, cache the throughputs and use them.

    About two seconds, once per machine (``force=True`` measures again).  Runs in a graph
    and session of its own; the caller's graphs are untouched.
    """
    global _current
    key = machine_key()
    if not force:
        cached = _load(key)
        if cached is not None:
            _use(cached)
            return cached
    measured = _measure(repeats)
    _save(key, measured)
    _use(measured)
    logger.info("time model calibrated: %s", measured.as_dict())
    return measured


def _use(throughput: Throughput) -> None:
    global _current
    with _lock:
        _current = throughput
    from . import memo

    memo.forget()  # plans remembered with the figures of the throughputs used before


def _measure(repeats: int) -> Throughput:
    from ._tensorflow import tf, tf_gradients

    def best_seconds(session, fetches) -> float:
        session.run(fetches)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            session.run(fetches)
            times.append(time.perf_counter() - start)
        return min(times)

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        image = tf.Variable(tf.random.normal([32, 32, 32, 32]))
        kernel = tf.Variable(tf.random.normal([3, 3, 32, 32]))
        square = tf.Variable(tf.random.normal([768, 768]))
        vector = tf.Variable(tf.random.normal([1 << 22]))
        scale, offset = tf.Variable(tf.ones([32])), tf.Variable(tf.zeros([32]))
        tiny = tf.Variable(1.0)
        kernels = {
            "conv": (lambda: tf.nn.conv2d(image, kernel, 1, "SAME"), 2.0 * 32 * 32 * 32 * 32 * 9 * 32),
            "matmul": (lambda: tf.matmul(square, square), 2.0 * 768 ** 3),
            "norm": (lambda: tf.compat.v1.nn.fused_batch_norm(image, scale, offset)[0],
                     10.0 * 32 * 32 * 32 * 32),
            "other": (lambda: tf.tanh(vector), float(1 << 22)),
        }
        built = {}
        for kind, (make, flops) in kernels.items():
            out = make()
            sources = [v for v in (image, kernel, square, vector, scale, offset)
                       if v.dtype == out.dtype]
            grads = [g for g in tf_gradients(tf.reduce_sum(out), sources) if g is not None]
            built[kind] = (out, grads, flops, out.shape.num_elements() * 4)
        chain = tiny
        for _ in range(200):
            chain = chain * 1.0001
        # chains of elementwise products over a vector that fits the cache and one that
        # does not: what a cached byte costs over one from memory (differences of two
        # chain lengths, so that the run's own cost cancels)
        cache = cache_bytes()
        scaled = {}
        for nbytes, long in ((cache // 8, 17), (4 * cache, 3)) if cache else ():
            vector = tf.Variable(tf.zeros([nbytes // 4]))
            ends = [vector * 1.0001]
            for _ in range(long - 1):
                ends.append(ends[-1] * 1.0001)
            scaled[nbytes] = (ends[0], ends[-1], long - 1)
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto()
    # as written: grappler would fold the chains of products into one op
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        per_op = best_seconds(session, chain.op) / 200
        rates, backward = {}, {}
        bandwidth = None
        for kind, (out, grads, flops, out_bytes) in built.items():
            forward = max(best_seconds(session, out.op) - per_op, 1e-7)
            both = best_seconds(session, [out.op] + [g.op for g in grads])
            backward[kind] = max(0.5, round((both - per_op - forward) / forward, 2))
            rates[kind] = flops / forward
            if kind == "other":
                bandwidth = 2 * out_bytes / forward  # reads and writes the whole vector
        share = DEFAULT_CACHED_TRAFFIC_SHARE
        if scaled:
            per_byte = []  # seconds per byte read and written, cached then from memory
            for nbytes, (one, last, more) in sorted(scaled.items()):
                extra = best_seconds(session, last.op) - best_seconds(session, one.op)
                per_byte.append(max(extra, 1e-9) / (more * 2 * nbytes))
            share = min(1.0, max(0.05, round(per_byte[0] / per_byte[1], 2)))
    return Throughput(rates, bandwidth, per_op, backward, source=f"calibrated: {machine_key()}",
                      cached_traffic_share=share)


def as_text(throughput: Throughput) -> str:
    """One line for logs and reports."""
    rates = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in throughput.flops_per_second.items())
    return (f"GFLOP/s {rates}; {throughput.bytes_per_second / 1e9:.1f} GB/s; "
            f"{1e6 * throughput.seconds_per_op:.0f} us per op ({throughput.source})")



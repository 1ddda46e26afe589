"""Measured peak memory: of a TF2 step (eager, ``tf.function``, Keras ``fit``), or of
a traced ``tf.compat.v1`` ``Session.run``.

Layer: analysis (measures; changes no graph); imports: notices, _tensorflow.

TF2: :func:`peak_memory_during` resets the device allocator's statistics
(``tf.config.experimental.reset_memory_stats``), runs your code, and returns
the allocator's peak above the bytes it held when the code started
(``tf.config.experimental.get_memory_info``): on CPU and GPU alike.

v1 sessions: run a step with ``RunOptions(trace_level=FULL_TRACE)`` and a
``RunMetadata``; each node's memory stats list ``allocation_records`` (time,
bytes; negative bytes are frees) per allocator.  Sorting them by time and
taking the peak of the running sum gives the step's peak bytes on that
allocator, counting only tensors allocated during the step (not variables
allocated before it).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable

from . import notices
from ._tensorflow import gpu_visible, tf


def default_device() -> str:
    """``'GPU:0'`` where TensorFlow sees a GPU, else ``'CPU:0'``."""
    return "GPU:0" if gpu_visible() else "CPU:0"


def peak_memory_during(run: Callable[[], object], device: str | None = None) -> int:
    """Peak bytes the device's allocator held while ``run()`` ran, above what it
    held before (variables and data made earlier are not counted).

    Measure the second call of a ``tf.function`` step, so that tracing and
    the optimizer's slot variables are not in the figure::

        step(x)                                          # trace, warm up
        peak = peak_memory_during(lambda: step(x))

    On CPU this needs TensorFlow's default oneDNN allocator (its statistics
    count buffers of 256 KiB and more; smaller ones are not seen); with
    ``TF_ENABLE_ONEDNN_OPTS=0`` the CPU keeps no statistics and this raises
    a ``RuntimeError``.  Use :func:`peak_memory` on a traced ``Session.run``
    there.

    The allocator counts whole chunks: a request placed in a free chunk less than
    twice its size takes all of it, so this can exceed the bytes the step's tensors
    asked for (and ``plan()``'s prediction, which counts those), by what the
    allocator held before (a Keras U-Net step at batch 32 read 75-89 MiB here against
    63-79 MiB requested, step to step); :func:`peak_memory` sums the requests.  Logical CPUs
    (``tf.config.set_logical_device_configuration``) share one allocator: each of them
    gives the peak of all together.  A step whose every buffer is smaller than 256 KiB
    measures 0 on CPU, and a WARNING says why.
    """
    device = device or default_device()
    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError as error:
        raise RuntimeError(
            f"peak_memory_during: TensorFlow keeps no memory statistics for {device} "
            "here (on CPU they come with the default oneDNN allocator; is "
            "TF_ENABLE_ONEDNN_OPTS=0 set?). Measure a traced tf.compat.v1 Session.run "
            "with peak_memory(run_metadata) instead."
        ) from error
    start = tf.config.experimental.get_memory_info(device)["current"]
    run()
    peak = max(0, tf.config.experimental.get_memory_info(device)["peak"] - start)
    if not peak and "CPU" in device.upper():
        notices.logger.warning(
            "peak_memory_during measured 0 bytes on %s: its allocator's statistics count "
            "only buffers of 256 KiB and more, so a step of smaller tensors reads 0. Measure "
            "a traced tf.compat.v1 Session.run with peak_memory(run_metadata) instead.", device)
    return peak


def allocation_records(run_metadata: tf.compat.v1.RunMetadata) -> dict[str, list[tuple[int, int]]]:
    """``{allocator name: [(micros, bytes), ...]}`` from a RunMetadata's step stats."""
    return _records_by(run_metadata, lambda device, memory: memory.allocator_name)


def _records_by(run_metadata, key: Callable) -> dict:
    """``{key(device stats, memory stats): [(micros, bytes), ...]}`` of a traced step."""
    records = collections.defaultdict(list)
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            for memory in node.memory:
                for record in memory.allocation_records:
                    records[key(device, memory)].append(
                        (record.alloc_micros, record.alloc_bytes)
                    )
    return dict(records)


def running_peak(records: Iterable[tuple[int, int]]) -> int:
    """The peak of the running sum of ``(micros, bytes)`` allocation records (negative
    bytes are frees), in time order.

    Records at the same microsecond are applied frees first, so that the peak
    is not overstated by the clock's coarseness.
    """
    running = peak = 0
    for _, size in sorted(records):
        running += size
        peak = max(peak, running)
    return peak


def peak_memory(run_metadata: tf.compat.v1.RunMetadata) -> dict[str, int]:
    """Peak bytes per allocator (device) of a traced step, e.g. ``{'cpu': 123456}``.

    Allocators that the step never used are absent (see :func:`running_peak`).
    """
    return {allocator: running_peak(records)
            for allocator, records in allocation_records(run_metadata).items()}


def peak_memory_by_device(run_metadata: tf.compat.v1.RunMetadata) -> dict[str, int]:
    """Peak bytes per device of a traced step, keyed by the step stats' device name.

    Logical devices of one physical device share an allocator (two logical
    CPUs both report ``'cpu'``/``'mklcpu'``), so :func:`peak_memory` cannot
    tell them apart.  Here each node's allocation records count towards the
    device the node ran on (e.g. ``'/job:localhost/replica:0/task:0/device:CPU:1'``):
    the memory of the tensors that device's ops allocated.
    """
    records = _records_by(run_metadata, lambda device, memory: device.device)
    return {name: running_peak(device_records) for name, device_records in records.items()}


def executed_op_types(run_metadata: tf.compat.v1.RunMetadata) -> collections.Counter[str]:
    """How many ops of each type a traced step ran, from its step stats.

    oneDNN's kernel prefixes are removed (``_MklNativeConv2D`` counts as
    ``Conv2D``), so that the counts compare with :attr:`Plan.recomputed_ops`:
    what a checkpointed step runs beyond plain ``tf.gradients`` is what it
    recomputes, and an op type that grappler rewrites away does not appear.
    """
    counts = collections.Counter()
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            label = node.timeline_label
            if " = " in label:  # 'name = Type(inputs)'
                kind = label.split(" = ", 1)[1].split("(", 1)[0]
                counts[kind.replace("_MklNative", "").replace("_Mkl", "")] += 1
    return counts


def traced_run(session: tf.compat.v1.Session, fetches: Any, feed_dict: dict | None = None,
               runs: int = 2) -> tuple[Any, tf.compat.v1.RunMetadata]:
    """Run ``fetches`` ``runs`` times with full tracing; return (values, RunMetadata of the last).

    The first run warms up (allocator pools, grappler); measure the last.
    """
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    values = metadata = None
    for _ in range(runs):
        metadata = tf.compat.v1.RunMetadata()
        values = session.run(fetches, feed_dict=feed_dict, options=options, run_metadata=metadata)
    return values, metadata

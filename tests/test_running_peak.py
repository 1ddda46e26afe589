"""Unit tests of profiling's running peak over allocation records (no session run)."""

from __future__ import annotations

import pytest

from memory_saving_gradients import profiling
from memory_saving_gradients._tensorflow import tf

pytestmark = pytest.mark.unit


def _metadata(nodes):
    """A RunMetadata with ``nodes``: ``(device, allocator, [(micros, bytes), ...])``."""
    metadata = tf.compat.v1.RunMetadata()
    for device, allocator, records in nodes:
        dev = next((d for d in metadata.step_stats.dev_stats if d.device == device), None)
        if dev is None:
            dev = metadata.step_stats.dev_stats.add(device=device)
        memory = dev.node_stats.add().memory.add(allocator_name=allocator)
        for micros, nbytes in records:
            memory.allocation_records.add(alloc_micros=micros, alloc_bytes=nbytes)
    return metadata


def test_frees_at_the_same_microsecond_come_first():
    # applied in record order the peak would be 150; frees first, 100
    assert profiling.running_peak([(0, 100), (1, 50), (1, -100)]) == 100
    assert profiling.running_peak([]) == 0


def test_peaks_by_allocator_and_by_device():
    metadata = _metadata([
        ("CPU:0", "cpu", [(0, 64), (5, -64)]),
        ("CPU:1", "cpu", [(2, 32), (3, -32)]),
        ("CPU:1", "mklcpu", [(1, 8)]),
    ])
    # one allocator shared by two devices: their records interleave in time
    assert profiling.peak_memory(metadata) == {"cpu": 96, "mklcpu": 8}
    assert profiling.peak_memory_by_device(metadata) == {"CPU:0": 64, "CPU:1": 40}


def test_a_step_of_buffers_under_256_kib_measures_0_and_says_why(caplog):
    """The CPU allocator's statistics count buffers of 256 KiB and more: a step of
    smaller tensors reads 0, which peak_memory_during returned without a word (a
    helper's trial: a width-64 MLP at batch 512).  A large buffer reads its size."""
    import logging

    small = tf.function(lambda x: tf.reduce_sum(tf.tanh(x) * 2.0))
    large = tf.function(lambda x: tf.reduce_sum(tf.tanh(x) * 2.0))
    x_small, x_large = tf.ones([64, 64]), tf.ones([1024, 1024])
    small(x_small), large(x_large)
    with caplog.at_level(logging.WARNING, logger="memory_saving_gradients"):
        assert profiling.peak_memory_during(lambda: small(x_small), "CPU:0") == 0
        said = [r.getMessage() for r in caplog.records]
        assert any("measured 0 bytes" in m and "256 KiB" in m for m in said), said
        caplog.clear()
        assert profiling.peak_memory_during(lambda: large(x_large), "CPU:0") >= 4 * 2**20
        assert not caplog.records, [r.getMessage() for r in caplog.records]

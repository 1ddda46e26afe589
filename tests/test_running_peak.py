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

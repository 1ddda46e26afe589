"""The ``own_process`` marker (``tests/conftest.py``): a test that carries it runs
in a new Python process of its own, whose allocator no earlier test has used."""

from __future__ import annotations

import os

import pytest
from conftest import OWN_PROCESS_ENV

from memory_saving_gradients._tensorflow import tf

pytestmark = [pytest.mark.subprocess, pytest.mark.own_process, pytest.mark.slow]


def test_a_marked_test_runs_in_a_new_process_with_a_fresh_allocator():
    assert os.environ.get(OWN_PROCESS_ENV) == "1"
    # nothing of 256 KiB or more (what the CPU statistics count) was allocated before
    assert tf.config.experimental.get_memory_info("CPU:0")["peak"] < 2**18
    kept = tf.ones([2**20])  # 4 MiB
    assert tf.config.experimental.get_memory_info("CPU:0")["current"] >= 4 * 2**20
    del kept

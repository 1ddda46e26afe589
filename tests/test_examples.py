"""Every script in examples/ runs at its default (tiny) size and saves memory.

Each example's ``main(argv)`` returns what it printed; the scripts are run
in this process (their imports are the library's public API only).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

pytestmark = pytest.mark.memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(name: str):
    path = os.path.join(ROOT, "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param("keras_tf_data", marks=pytest.mark.keras),
    pytest.param("tf_keras_fit", marks=pytest.mark.keras),
    pytest.param("custom_loop", marks=pytest.mark.keras),  # a tf.keras optimizer
    pytest.param("xla_step", marks=pytest.mark.xla),
])
def test_training_examples_train_alike_and_save_memory(name):
    if name == "tf_keras_fit":
        pytest.importorskip("tf_keras", reason="tf-keras is a test extra (pip install tf-keras)")
    result = _example(name).main([])
    np.testing.assert_allclose(result["losses"], result["plain_losses"], rtol=1e-5)
    assert result["peak"] < 0.8 * result["plain_peak"], result


@pytest.mark.slow
def test_v1_graph_example():
    result = _example("v1_graph").main([])
    peaks = result["peaks"]
    assert peaks["gradients(checkpoints='memory')"] < 0.8 * peaks["tf.gradients"], peaks
    assert peaks["patched tf.gradients"] < 0.8 * peaks["tf.gradients"], peaks
    assert result["max_difference"] < 1e-4


@pytest.mark.slow
def test_budget_example_meets_its_budgets():
    result = _example("budget_plan").main([])
    assert result["rows"], "no budget was feasible"
    for budget, predicted, measured, _ in result["rows"]:
        assert predicted <= budget
        assert measured <= 1.15 * budget, (measured, budget)


@pytest.mark.slow
@pytest.mark.keras
def test_largest_batch_example_fits_and_checkpointing_trains_a_larger_batch():
    result = _example("largest_batch").main([])
    rows = result["rows"]
    for name, row in rows.items():
        assert 0 < row["held"] <= result["memory"], (name, row)
        assert np.isfinite(row["loss"])
    assert rows["checkpoints='memory'"]["batch"] > 1.5 * rows["tf.gradients"]["batch"], rows

"""The time model (memory_saving_gradients.timing): the roofline, kinds, the calibration cache."""

from __future__ import annotations

import json

import pytest

from memory_saving_gradients import timing

MODEL = timing.Throughput(
    flops_per_second={"conv": 100.0, "matmul": 50.0, "norm": 10.0, "other": 1.0},
    bytes_per_second=10.0, seconds_per_op=0.5, backward={"conv": 2.0, "other": 1.5})


@pytest.mark.unit
def test_an_op_costs_its_slower_roof_plus_the_fixed_cost():
    assert timing.op_seconds(1000, 10, "conv", MODEL) == pytest.approx(10.5)   # compute-bound
    assert timing.op_seconds(10, 1000, "conv", MODEL) == pytest.approx(100.5)  # memory-bound
    assert timing.op_seconds(0, 0, "other", MODEL) == pytest.approx(0.5)       # the kernel's fixed cost
    assert timing.op_seconds(100, 0, "unknown kind", MODEL) == pytest.approx(100.5)  # as "other"


@pytest.mark.unit
def test_backward_factor_per_kind_with_other_as_default():
    assert timing.backward_seconds(3.0, "conv", MODEL) == pytest.approx(6.0)
    assert timing.backward_seconds(3.0, "norm", MODEL) == pytest.approx(4.5)


@pytest.mark.unit
@pytest.mark.parametrize("op_type, kind", [
    ("Conv2D", "conv"), ("_FusedConv2D", "conv"), ("BatchMatMulV2", "matmul"),
    ("FusedBatchNormV3", "norm"), ("Relu", "other"), ("AddV2", "other")])
def test_kind_of(op_type, kind):
    assert timing.kind_of(op_type) == kind


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MSG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "_current", None)
    assert timing.current() is timing.DEFAULT  # nothing cached, nothing measured
    measured = timing.calibrate(repeats=2)
    for kind in timing.KINDS:
        assert measured.flops_per_second[kind] > 0 and measured.backward[kind] >= 0.5
    assert measured.bytes_per_second > 0 and measured.seconds_per_op > 0
    assert timing.current() == measured
    stored = json.loads((tmp_path / "throughput.json").read_text())
    assert timing.Throughput.from_dict(stored[timing.machine_key()]) == measured
    monkeypatch.setattr(timing, "_measure", lambda repeats: pytest.fail("measured again"))
    assert timing.calibrate() == measured  # from the cache


def test_an_unreadable_cache_means_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("MSG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "_current", None)
    (tmp_path / "throughput.json").write_text("not json")
    assert timing.current() is timing.DEFAULT


@pytest.mark.unit
def test_the_planner_weighs_recomputation_in_the_time_models_seconds(monkeypatch):
    """The work the planner minimises is the time model's seconds of the copies that run:
    a throughput that makes matrix products slower makes the same plan's work larger by
    the products' share, and recompute_cost is that work over the forward pass's."""
    import numpy as np
    import tensorflow as tf

    from memory_saving_gradients import graph as graph_lib
    from memory_saving_gradients import simulate

    graph = tf.Graph()
    with graph.as_default():
        rng = np.random.default_rng(0)
        h = tf.constant(rng.standard_normal((256, 64)).astype("float32"))
        weights, kept = [], []
        for _ in range(6):
            w = tf.constant(rng.standard_normal((64, 64)).astype("float32") / 8)
            weights.append(w)
            h = tf.tanh(tf.matmul(h, w))
            kept.append(h)
        loss = tf.reduce_sum(h)
        region = graph_lib.forward_region([loss], weights)
    works = {}
    for matmul_rate in (1e10, 1e8):
        rates = {"conv": 1e10, "matmul": matmul_rate, "norm": 1e10, "other": 1e10}
        model = timing.Throughput(rates, bytes_per_second=1e13, seconds_per_op=1e-6,
                                  backward={"other": 1.0})
        monkeypatch.setattr(timing, "_current", model)
        prediction = simulate.predict_checkpointed(region, [loss], weights, kept[1::2])
        assert prediction.recompute_cost == pytest.approx(
            prediction.recompute_seconds / prediction.forward_work)
        counts = dict(prediction.recomputed_ops)
        works[matmul_rate] = (prediction.recompute_work, counts)
    (fast, counts), (slow, same_counts) = works[1e10], works[1e8]
    assert counts == same_counts and counts.get("MatMul", 0) > 0, counts
    flops = 2 * 256 * 64 * 64  # one product
    assert slow - fast == pytest.approx(counts["MatMul"] * flops * (1 / 1e8 - 1 / 1e10), rel=1e-6)

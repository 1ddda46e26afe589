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

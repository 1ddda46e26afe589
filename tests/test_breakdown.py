"""The benchmark's time breakdown (bench/breakdown.py): phases, op types, busy time, one tiny run."""

from __future__ import annotations

import pytest

from bench import breakdown


@pytest.mark.unit
@pytest.mark.parametrize("name, phase", [
    ("block3/conv/Conv2D", "forward"),
    ("gradients/block3/conv/Conv2D_grad/Conv2DBackpropInput", "backward"),
    ("gradients_1/AddN", "backward"),
    ("gradients/recompute_4/block3/conv/Conv2D", "recompute"),
    ("gradients/backprop_4/recompute_4/block3/conv/Conv2D_grad/Conv2DBackpropFilter", "backward"),
    ("gradient_tape/model/dense/MatMul/MatMul_1", "backward"),
    ("recompute_grad_3/dense/MatMul", "forward"),
])
def test_phase_of_reads_the_name_scopes(name, phase):
    assert breakdown.phase_of(name) == phase


@pytest.mark.unit
def test_op_type_of_strips_onednn_prefixes():
    assert breakdown.op_type_of("a/b = _MklNativeConv2DBackpropFilter(x, y)") == "Conv2DBackpropFilter"
    assert breakdown.op_type_of("a = _MklFusedBatchNormGradV3(x)") == "FusedBatchNormGradV3"
    assert breakdown.op_type_of("") == "?"


@pytest.mark.unit
def test_busy_seconds_is_the_union_of_intervals():
    assert breakdown.busy_seconds([(0, 10), (5, 15), (20, 30), (21, 22)]) == pytest.approx(25e-6)
    assert breakdown.busy_seconds([]) == 0


def test_traced_steps_of_a_tiny_chain_split_into_phases():
    import test_models
    from bench import core

    spec = core.spec_from_module(test_models.chain, n=12, size=4096, kind="tanh")
    prepared = [core.prepare(spec, v, predict=False) for v in ("tf.gradients", "memory")]
    try:
        plain, ours = breakdown.measure(prepared, steps=2)
    finally:
        for p in prepared:
            p.close()
    assert len(plain.steps) == len(ours.steps) == 2
    assert plain.median(breakdown.FIGURES["recompute"]) == 0
    assert ours.steps[0].nodes.get("recompute", 0) > 0  # the copies ran and were counted
    for b in (plain, ours):
        assert b.median(breakdown.FIGURES["backward"]) > 0
        assert 0 < b.median(breakdown.FIGURES["wall"])
    text = breakdown.table([plain, ours])
    assert "memory" in text and "1.00x" in text
    assert breakdown.COUNTS["recompute nodes"](ours.steps[0]) > 0
    assert breakdown.COUNTS["recompute nodes"](plain.steps[0]) == 0
    assert all(breakdown.COUNTS["overlap"](s) >= 0.99 for s in plain.steps + ours.steps)
    # a phase the baseline lacks is ranked by the variants that have it
    recomputed = breakdown.op_type_table([plain, ours], phase="recompute")
    assert "Tanh" in recomputed, recomputed

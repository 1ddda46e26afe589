"""The step-time prediction's cache term (memory_saving_gradients.step_time, simulate.timed_seconds).

What is asserted, and why:

- the stack distance counts distinct bytes: a buffer read back after many touches of
  one small buffer is still cached, one read back after as many distinct bytes is not;
- a write is cached where it can take recently freed memory, not otherwise;
- with no cache (0 bytes) a replay's timed seconds are exactly the time model's sum
  without the term (forward, backward, copies, gradients taken again): the term
  changes nothing else;
- on the tanh chain (1 MiB tensors, 100 of them, a 32 MiB cache) plain
  ``tf.gradients`` reads its activations back from memory and ``'memory'``'s
  recomputed segments are read from the cache, so the term lowers ``'memory'``'s
  predicted step ratio (measured 1.09-1.13x, predicted 1.40x without the term), and
  keeping every tanh output (no segment in the cache) it lowers it much less.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import memory_saving_gradients as msg
from memory_saving_gradients import memo, simulate, step_time, timing
from test_models import chain

MiB = 1 << 20
INF = float("inf")


@pytest.mark.unit
def test_a_read_is_cached_where_the_distinct_bytes_since_fit():
    buffers = {"a": [0, 3, MiB], "b": [1, 2, MiB // 4], "c": [1, 3, 3 * MiB]}
    # a written at 0; b touched at 1 and many times at 2 (one distinct buffer); a read at 3
    reads = [(2, "b")] * 10 + [(3, "a")]
    traffic = step_time.cached_traffic(buffers, reads, [3], cache_bytes=5 * MiB)
    assert traffic[3] == (MiB, 0)  # distinct since: b and c, 3.25 MiB; with a, 4.25 <= 5
    traffic = step_time.cached_traffic(buffers, reads, [3], cache_bytes=4 * MiB)
    assert traffic[3] == (0, MiB)  # 4.25 MiB do not fit 4


@pytest.mark.unit
def test_a_write_is_cached_where_it_takes_recently_freed_memory():
    buffers = {"a": [0, 1, MiB], "b": [2, INF, MiB], "c": [3, INF, 2 * MiB]}
    traffic = step_time.cached_traffic(buffers, [(1, "a")], [2, 3], cache_bytes=8 * MiB)
    assert traffic[2] == (MiB, 0)  # b takes a's memory, freed after step 1
    assert traffic[3] == (0, 2 * MiB)  # nothing freed is large enough for c: fresh memory
    fits = step_time.cached_traffic(buffers, [(1, "a")], [2, 3], cache_bytes=8 * MiB, fits=True)
    assert fits[3] == (2 * MiB, 0)  # the whole footprint fits: every byte is cached


@pytest.mark.unit
def test_no_cache_leaves_the_time_model_as_it_was(monkeypatch):
    monkeypatch.setattr(timing, "cache_bytes", lambda: 0)
    with tf.Graph().as_default():
        for build in (lambda: chain.build_tanh_chain(n=20, size=4096),
                      lambda: chain.build(n=12, size=4096, kind="residual")):
            model = build()
            region, xs = _region(model.loss, model.inputs)
            size = simulate.Sizer()
            kept = model.units[4::5]
            predicted = simulate.predict_checkpointed(region, [model.loss], xs, kept, sizer=size,
                                                      timed=True)
            plain = simulate.predict_baseline(region, [model.loss], xs, sizer=size, timed=True)
            assert predicted.recompute_seconds > 0
            assert predicted.timed_seconds == pytest.approx(
                predicted.forward_seconds + predicted.backward_seconds + predicted.recompute_work,
                rel=1e-9)
            assert plain.timed_seconds == pytest.approx(
                plain.forward_seconds + plain.backward_seconds, rel=1e-9)


def test_the_tanh_chain_recomputes_from_the_cache(monkeypatch):
    ratios = {}
    for cache in (0, 32 * MiB):
        monkeypatch.setattr(timing, "cache_bytes", lambda cache=cache: cache)
        memo.forget()  # plans are remembered by structure, with their figures
        with tf.Graph().as_default():
            model = chain.build_tanh_chain()  # 100 tanh of 1 MiB
            ratios[cache, "memory"] = msg.plan(model.loss, model.inputs,
                                               checkpoints="memory").predicted_step_ratio
            ratios[cache, "all kept"] = msg.plan(model.loss, model.inputs,
                                                 checkpoints=model.units[:-1]).predicted_step_ratio
    # without the term: each of 100 tanh recomputed at the forward's price
    assert ratios[0, "memory"] == pytest.approx(1.40, abs=0.02)
    # with it: the segments' gradients and copies find their tensors in the cache
    assert ratios[32 * MiB, "memory"] < ratios[0, "memory"] - 0.15, ratios
    # every tanh output kept: the gradients read them back from memory as plain's do
    assert (ratios[0, "all kept"] - ratios[32 * MiB, "all kept"]
            < 0.5 * (ratios[0, "memory"] - ratios[32 * MiB, "memory"])), ratios


def test_calibration_measures_the_cached_share(tmp_path, monkeypatch):
    monkeypatch.setenv("MSG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "_current", None)
    monkeypatch.setattr(timing, "cache_bytes", lambda: 8 * MiB)  # small: a quick calibration
    measured = timing.calibrate(force=True, repeats=2)
    assert 0.05 <= measured.cached_traffic_share <= 1.0
    entry = measured.as_dict()
    del entry["cached_traffic_share"]  # a calibration cached before the term
    assert timing.Throughput.from_dict(entry).cached_traffic_share == timing.DEFAULT_CACHED_TRAFFIC_SHARE


def _region(loss, xs):
    from memory_saving_gradients import checkpointing

    problem = checkpointing._prepare([loss], xs, None)
    return problem.region, problem.xs

"""The benchmark's Keras suite (bench.keras_suite): rows, ratios,
outputs, and one tiny case run in its own process as the suite runs it."""

from __future__ import annotations

import csv
import os

import pytest

from bench import cli, keras_suite
from bench.keras_suite import Row


def _rows():
    return [
        Row("gpt2_fit", "plain", fit_rss_mb=400.0, alloc_peak_mb=200.0, step_s=0.5,
            losses=[7.0, 6.9]),
        Row("gpt2_fit", "patched", fit_rss_mb=200.0, alloc_peak_mb=80.0, step_s=0.6,
            losses=[7.0, 6.9 * (1 + 1e-6)]),
        Row("gpt2_fit", "enable", fit_rss_mb=210.0, alloc_peak_mb=90.0, step_s=0.65,
            losses=[7.0, 6.8]),
        Row("gpt2_fit", "remat", error="ValueError: custom_gradient keywords"),
        Row("bert_fit", "patched", fit_rss_mb=1.0, alloc_peak_mb=1.0, step_s=1.0,
            losses=[1.0]),  # no plain row: no ratios
    ]


@pytest.mark.unit
def test_compare_fills_ratios_and_loss_equality_against_plain():
    rows = keras_suite.compare(_rows())
    plain, patched, enable, remat, orphan = rows
    assert plain.rss_ratio == 1.0 and plain.losses_equal is True
    assert patched.rss_ratio == pytest.approx(0.5)
    assert patched.alloc_ratio == pytest.approx(0.4)
    assert patched.time_ratio == pytest.approx(1.2)
    assert patched.losses_equal is True
    assert enable.losses_equal is False
    assert remat.losses_equal is None and remat.rss_ratio is None
    assert orphan.rss_ratio is None and orphan.losses_equal is None


@pytest.mark.unit
def test_outputs_have_every_row_and_say_which_failed(tmp_path):
    rows = keras_suite.compare(_rows())
    written = keras_suite.write_outputs(str(tmp_path), rows, header="# Keras suite\n")
    with open(written["csv"]) as f:
        table = list(csv.DictReader(f))
    assert [(r["case"], r["variant"]) for r in table] == [(r.case, r.variant) for r in rows]
    assert table[1]["losses_equal"] == "yes" and table[2]["losses_equal"] == "NO"
    assert table[3]["note"].startswith("FAILED: ValueError")
    md = open(written["md"]).read()
    assert md.startswith("# Keras suite") and "| gpt2_fit | remat |" in md
    assert "0.50x" in md  # patched's RSS ratio
    if "png" in written:
        assert os.path.getsize(written["png"]) > 0


@pytest.mark.unit
def test_cli_accepts_suite_keras():
    args = cli.parser().parse_args(["--suite", "keras", "--quick", "--out", "x"])
    assert args.suite == "keras" and args.quick
    assert cli.parser().parse_args([]).suite == "default"


@pytest.mark.unit
def test_error_description_skips_keras_wrapper_line():
    error = ValueError("Exception encountered when calling Functional.call().\n\n"
                       "\x1b[1mThe custom_gradient decorator needs eager.\x1b[0m\n\nArguments")
    assert keras_suite.describe_error(error) == (
        "ValueError: The custom_gradient decorator needs eager.")
    autograph = ValueError("in user code:\n\n    File \"x.py\", line 3, in step  *\n"
                           "        loss = f(x)\n\n    ValueError: Exception encountered "
                           "when calling Functional.call().\n\n    Keywords need eager.\n")
    assert keras_suite.describe_error(autograph) == "ValueError: Keywords need eager."


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.keras
@pytest.mark.memory
def test_tiny_case_in_its_own_process_trains_and_measures():
    size = keras_suite.sizes_for("keras3_fit", quick=True)
    plain = keras_suite.run_in_subprocess("keras3_fit", "plain", size, timeout=300)
    patched = keras_suite.run_in_subprocess("keras3_fit", "patched", size, timeout=300)
    for row in (plain, patched):
        assert row.error is None, row.error
        assert len(row.losses) == size["warm_steps"] + size["steps"]
        assert row.fit_rss_mb > 0 and row.step_s > 0
    keras_suite.compare([plain, patched])
    assert patched.losses_equal is True


def test_variant_that_does_not_apply_is_refused():
    with pytest.raises(ValueError, match="does not apply"):
        keras_suite.run_case("custom_loop", "enable", keras_suite.sizes_for("custom_loop", True))

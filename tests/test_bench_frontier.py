"""The benchmark's frontier checks (issue 23, item 3) and the timed fits search (item 4).

Unit tests run the checks on hand-made rows and the search on a fake model of
peak and step time; one smoke test runs ``python -m bench`` on a tiny ResNet.
"""

import csv
import math

import pytest

from bench import cli, fits, report
from bench.core import Result, relative_spread
from bench.sweep import Row

MIB = 2**20


def row(variant, peak, cpu, wall=None, run=1, budget_mb=None, predicted=None, cpu_noise=0.01,
        noise=0.01, size="depth=110", spread=None):
    """A measured row: ratios to tf.gradients as given (wall time = CPU time unless given)."""
    result = Result("resnet", size, 32, variant, peak_bytes=int(peak * 40 * MIB),
                    budget_bytes=None if budget_mb is None else int(budget_mb * MIB),
                    predicted_time_ratio=predicted, cpu_spread=spread)
    return Row(result, peak_ratio=peak, time_ratio=cpu if wall is None else wall, cpu_ratio=cpu,
               noise=noise, cpu_noise=cpu_noise, run=run)


def frontier_rows(run=1, rg_cpu=1.20, rg_wall=1.19, point_cpu=1.21, point_wall=1.20, point_peak=0.24):
    """ResNet-110-like: plain, per-unit recompute_grad at 0.249x, 'memory' and three budget points."""
    return [
        row("tf.gradients", 1.0, 1.0, run=run),
        row("recompute_grad", 0.249, rg_cpu, rg_wall, run=run),
        row("memory", 0.19, 1.40, run=run, predicted=1.30),
        row("frontier", point_peak, point_cpu, point_wall, run=run, budget_mb=10),
        row("frontier", 0.40, 1.10, run=run, budget_mb=16),
        row("frontier", 0.98, 1.00, run=run, budget_mb=40),
    ]


@pytest.mark.unit
def test_frontier_check_needs_cpu_and_wall_time_within_twice_the_noise():
    checks = {c["anchor"]: c for c in report.frontier_checks(frontier_rows())}
    assert set(checks) == {"tf.gradients", "recompute_grad"}  # 'memory' is on the curve, no anchor
    rg = checks["recompute_grad"]
    # 1.21 against 1.20 is within 2 x 1% noise in both clocks
    assert rg["ours"] == pytest.approx(1.21) and rg["ours_wall"] == pytest.approx(1.20)
    assert rg["ok_cpu"] and rg["ok_wall"] and rg["ok"]

    slower_wall = {c["anchor"]: c for c in report.frontier_checks(frontier_rows(point_wall=1.25))}
    rg = slower_wall["recompute_grad"]
    assert rg["ok_cpu"] and rg["ok_wall"] is False and rg["ok"] is False  # 1.25 > 1.19 x 1.02

    slower_cpu = {c["anchor"]: c for c in report.frontier_checks(frontier_rows(point_cpu=1.26))}
    assert slower_cpu["recompute_grad"]["ok"] is False

    # no frontier point at or below the anchor's peak: nothing to say
    above = {c["anchor"]: c for c in report.frontier_checks(frontier_rows(point_peak=0.30))}
    assert above["recompute_grad"]["ours"] == pytest.approx(1.40)  # only 'memory' peaks lower
    table = report.frontier_table(list(checks.values()))
    assert "| resnet depth=110 | recompute_grad | 0.249 | 1.20x | 1.21x | 1% | 1.19x | 1.20x | 1% | yes | yes | yes |" \
        in table


@pytest.mark.unit
def test_monotone_check_finds_a_larger_peak_that_is_slower():
    (ok,) = report.monotone_checks(frontier_rows())
    assert ok["points"] == 4 and ok["ok"]
    assert ok["cpu_worst"] <= 2 * 0.01

    # the case: a budget at 0.16x slower than one at 0.14x
    rows = frontier_rows() + [row("frontier", 0.14, 1.13, budget_mb=6), row("frontier", 0.16, 1.22, budget_mb=7)]
    (bad,) = report.monotone_checks(rows)
    assert not bad["ok"]
    assert bad["cpu_worst"] == pytest.approx(1.40 / 1.13 - 1)  # 'memory' (0.19x) against the 0.14x point
    assert bad["cpu_pair"] == ((0.14, 1.13), (0.19, 1.40))
    assert "NO" in report.monotone_table([bad])


@pytest.mark.unit
def test_monotone_check_compares_points_of_the_same_peak_both_ways():
    """Two budgets with the same plan peak within PEAK_JITTER: the slower one is a
    violation whichever reads the higher peak."""
    base = [row("tf.gradients", 1.0, 1.0), row("memory", 0.10, 1.5)]
    for first, second in ((1.13, 1.22), (1.22, 1.13)):
        rows = base + [row("frontier", 0.200, first, budget_mb=8),
                       row("frontier", 0.2005, second, budget_mb=9)]
        (check,) = report.monotone_checks(rows)
        assert check["cpu_worst"] == pytest.approx(1.22 / 1.13 - 1) and not check["ok"]
    # only wall time out of order: not monotone either
    rows = base + [row("frontier", 0.2, 1.1, wall=1.1), row("frontier", 0.5, 1.05, wall=1.3)]
    (check,) = report.monotone_checks(rows)
    assert check["cpu_worst"] <= 0 and check["wall_worst"] > 0.02 and not check["ok"]


@pytest.mark.unit
def test_memory_cost_check_bounds_the_measured_ratio_by_the_predicted_recomputation():
    assert report.recompute_cost_bound(1.15) == pytest.approx(1 + 1.1 * 0.15 + 0.03)
    rows = [row("tf.gradients", 1.0, 1.0), row("memory", 0.2, 1.24, predicted=1.20, size="depth=56"),
            row("memory", 0.2, 1.33, predicted=1.20), row("collection", 0.3, 1.5, predicted=1.1)]
    checks = report.recompute_cost_checks(rows)
    assert [(c["model"], c["ok"]) for c in checks] == [("resnet depth=56", True), ("resnet depth=110", False)]
    table = report.recompute_cost_table(checks)
    assert "| resnet depth=110 | 1.20x | 1.25x | 1.33x | 1.33x | NO |" in table


@pytest.mark.unit
def test_every_run_summary_holds_only_when_each_run_holds():
    rows = frontier_rows(run=1) + frontier_rows(run=2) + frontier_rows(run=3, point_cpu=1.30)
    summary = {s["check"]: s for s in report.every_run_summary(rows)}
    rg = summary["not slower than recompute_grad"]
    assert rg["runs"] == {1: True, 2: True, 3: False} and not rg["every"]
    assert summary["not slower than tf.gradients"]["every"]
    assert summary["monotone"]["every"]
    assert not summary["'memory' within its predicted recomputation"]["every"]  # 1.40 > 1.36

    # a check missing from a run does not hold in every run
    partial = frontier_rows(run=1) + [r for r in frontier_rows(run=2) if r.result.variant != "recompute_grad"]
    rg = {s["check"]: s for s in report.every_run_summary(partial)}["not slower than recompute_grad"]
    assert rg["runs"] == {1: True} and not rg["every"]
    table = report.every_run_table(report.every_run_summary(rows), [1, 2, 3])
    assert "| resnet depth=110 | not slower than recompute_grad | yes | yes | NO | NO |" in table
    assert "| resnet depth=110 | monotone | yes | yes | yes | yes |" in table


@pytest.mark.unit
def test_report_has_a_table_per_run_and_the_every_run_summary(tmp_path):
    rows = frontier_rows(run=1) + frontier_rows(run=2)
    text = "\n".join(report.frontier_sections(rows))
    for title in ("Frontier against the anchors", "The frontier is monotone",
                  "'memory' against its predicted recomputation", "Holds in every run"):
        assert f"## {title}" in text
    assert text.count("Run 1 of 2:") == 3 and text.count("Run 2 of 2:") == 3
    assert "Holds in every run" not in "\n".join(report.frontier_sections(frontier_rows()))
    assert "| run |" in report.markdown_table(rows).splitlines()[0]
    assert "| run |" not in report.markdown_table(frontier_rows()).splitlines()[0]


@pytest.mark.unit
def test_step_spread_is_the_interquartile_range_over_the_median_and_in_results_csv(tmp_path):
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(1.0)  # (4.5 - 1.5) / 3
    assert relative_spread([2.0] * 6) == 0.0
    assert relative_spread([1.0, 2.0, 3.0]) is None  # too few steps to say
    rows = [row("tf.gradients", 1.0, 1.0, spread=0.04), row("memory", 0.2, 1.3, spread=0.1, run=2)]
    path = tmp_path / "results.csv"
    report.write_csv(rows, str(path))
    with open(path) as f:
        written = list(csv.DictReader(f))
    assert [(r["run"], r["variant"], float(r["cpu_spread"])) for r in written] == [
        ("1", "tf.gradients", 0.04), ("2", "memory", 0.1)]


@pytest.mark.unit
def test_pareto_draws_every_run_with_error_bars(tmp_path):
    pytest.importorskip("matplotlib")
    rows = frontier_rows(run=1) + frontier_rows(run=2)
    for r in rows:
        r.result.cpu_spread = 0.08
    assert report._half_spread(rows[1]) == pytest.approx(1.20 * 0.04)
    path = report.plot_pareto(rows, str(tmp_path / "pareto.png"))
    assert path and (tmp_path / "pareto.png").stat().st_size > 1000


class FakeStep:
    """A fake budgeted step: the planner under-predicts the peak by ``overshoot`` MB; the
    least peak grows with depth; recomputation costs in proportion to what the budget
    leaves out of plain's peak."""

    least_per_layer = 0.05
    plain_per_layer = 0.3

    def __init__(self, log, depth, budget_bytes, overshoot=0.5, infeasible_below=None):
        self.depth, self.budget_mb = depth, budget_bytes / MIB
        self.log = log
        log.append(("build", depth, self.budget_mb))
        if infeasible_below is not None and self.budget_mb < infeasible_below:
            self.peak_mb, self.error = None, "ValueError: memory_budget cannot be met"
        else:
            self.peak_mb = max(self.least_per_layer * depth + 1, self.budget_mb + overshoot)
            self.error = None

    def time_ratio(self):
        self.log.append(("time", self.depth, self.budget_mb))
        plain = self.plain_per_layer * self.depth
        return 1 + 0.4 * max(0.0, 1 - self.budget_mb / plain)

    def close(self):
        self.log.append(("close", self.depth, self.budget_mb))


@pytest.mark.unit
def test_fits_in_time_finds_the_largest_depth_within_the_time_limit():
    log, probes = [], []
    fit = fits.fits_in_time(20.0, 1.25, None, fits.resnet_depth_axis(), k_guess=10,
                            build=lambda depth, budget: FakeStep(log, depth, budget),
                            on_probe=probes.append)
    # each depth: the cap overshoots by 0.5 MB, 19.5 MB fits; step 1 + 0.4 (1 - 19.5 / (0.3 depth))
    # is within 1.25x up to depth 173.3: ResNet-170 (6 x 28 + 2)
    assert fit.largest == 170 and not fit.hit_limit
    assert fit.peak_mb == pytest.approx(20.0) and fit.budget_mb == pytest.approx(19.5)
    assert fit.time_ratio == pytest.approx(1 + 0.4 * (1 - 19.5 / 51.0)) and fit.time_ratio <= 1.25
    assert fit.probe_time_ratios[176] > 1.25
    assert len(probes) == len(fit.probes) <= 2 * math.ceil(math.log2(60)) + 2
    for _, depth, _ in log:
        builds = [b for kind, d, b in log if d == depth and kind == "build"]
        timed = [kind for kind, d, _ in log if d == depth].count("time")
        near = abs(fit.probe_time_ratios[depth] - 1.25) <= fits.NEAR_LIMIT
        # the cap, then lowered by the measured overshoot; near the limit, two more builds
        # of the budget that fitted, each timed
        assert builds == [20.0, 19.5] + [19.5] * (2 if near else 0), depth
        assert timed == (fits.BUILDS_NEAR_LIMIT if near else 1), depth
        assert (depth in fit.probe_build_ratios) == near
    assert 170 in fit.probe_build_ratios and len(fit.probe_build_ratios[170]) == 3
    plain = fits.Fit("tf.gradients", 20.0, "depth", 20, 18.0, [])
    both = [plain, fit]
    fits.add_ratios(both)
    assert fit.ratio == pytest.approx(8.5)
    table = report.fits_table(both)
    assert "| 170 | 20.0 | 8.50x | 1.25x | 19.5 |" in table and "248: 20 at 1.30x" in table
    assert "step <= 1.25x tf.gradients" in table


@pytest.mark.unit
def test_a_ratio_near_the_limit_is_the_median_of_fresh_builds():
    log = []
    ratios = iter([1.24, 1.29, 1.27])  # first build just under the limit, the others over

    class Noisy(FakeStep):
        def time_ratio(self):
            super().time_ratio()
            return next(ratios)

    probe = fits.probe_with_budget(116, lambda b: Noisy(log, 116, b), 20.0, time_limit=1.25)
    assert probe.build_ratios == (1.24, 1.29, 1.27) and probe.time_ratio == pytest.approx(1.27)
    assert not probe.accepted(20.0, 1.25)
    builds = [b for kind, _, b in log if kind == "build"]
    assert builds == [20.0, 19.5, 19.5, 19.5]  # the rebuilds use the budget that fitted
    assert sorted(b for kind, _, b in log if kind == "close") == sorted(builds)

    # far from the limit: one build timed, as before
    log.clear()
    ratios = iter([1.10])
    probe = fits.probe_with_budget(116, lambda b: Noisy(log, 116, b), 20.0, time_limit=1.25)
    assert probe.time_ratio == pytest.approx(1.10) and probe.build_ratios == ()
    assert [kind for kind, _, _ in log].count("time") == 1

    fit = fits.Fit("memory, budget", 20.0, "depth", 110, 19.9, [(110, 19.9), (116, 20.0)],
                   time_limit=1.25, time_ratio=1.2, probe_time_ratios={110: 1.2, 116: 1.27},
                   probe_build_ratios={116: (1.24, 1.29, 1.27)})
    assert "116: 20 at 1.27x (median of 1.24/1.29/1.27)" in report.fits_table([fit])


@pytest.mark.unit
def test_fits_in_time_gives_up_on_a_depth_after_the_retries_and_never_times_it():
    log = []
    # the least peak is above the cap from depth 400: the budget never fits
    probe = fits.probe_with_budget(410, lambda b: FakeStep(log, 410, b, overshoot=1.0), 20.0)
    assert probe.peak_mb > 20.0 and probe.time_ratio is None
    assert [kind for kind, _, _ in log if kind != "close"] == ["build"] * (fits.BUDGET_RETRIES + 1)
    assert not probe.accepted(20.0, 1.25)

    # an infeasible budget (the planner's least peak above it) does not fit either
    log.clear()
    fit = fits.fits_in_time(20.0, 1.25, None, fits.Axis("depth", lambda k: 6 * k + 2, lambda v: v, 3),
                            build=lambda d, b: FakeStep(log, d, b, infeasible_below=100))
    assert fit.largest is None and "cannot be met" in fit.error
    assert "time" not in [kind for kind, _, _ in log]


@pytest.mark.unit
def test_budget_rises_when_the_peak_is_well_under_the_cap_and_the_largest_fitting_one_is_timed():
    log = []
    # the planner over-predicts by 3 MB: 20 MB peaks at 17, so the budget goes up to 23
    probe = fits.probe_with_budget(62, lambda b: FakeStep(log, 62, b, overshoot=-3.0), 20.0)
    assert (probe.budget_mb, probe.peak_mb) == (pytest.approx(23.0), pytest.approx(20.0))
    assert [(kind, b) for kind, _, b in log] == [
        ("build", 20.0), ("build", pytest.approx(23.0)), ("close", 20.0),
        ("time", pytest.approx(23.0)), ("close", pytest.approx(23.0))]

    # a plan that jumps above the cap past 22 MB: back down, and the larger of the two
    # budgets that fit (20 MB, not 19) is the one timed
    def jumping(budget_bytes):
        step = FakeStep(log, 62, budget_bytes, overshoot=-3.0)
        if step.budget_mb > 22:
            step.peak_mb = step.budget_mb + 1
        return step

    log.clear()
    probe = fits.probe_with_budget(62, jumping, 20.0)
    assert probe.budget_mb == pytest.approx(20.0) and probe.peak_mb == pytest.approx(17.0)
    assert [b for kind, _, b in log if kind == "build"] == [20.0, pytest.approx(23.0), pytest.approx(19.0)]
    assert [b for kind, _, b in log if kind == "time"] == [20.0]
    assert sorted(b for kind, _, b in log if kind == "close") == sorted(
        b for kind, _, b in log if kind == "build")  # every session released


@pytest.mark.unit
def test_timed_search_starts_between_plain_and_memory():
    axis = fits.resnet_depth_axis()
    found = [fits.Fit("tf.gradients", 48, "depth", 14, 34.5, []), fits.Fit("memory", 48, "depth", 146, 47.9, [])]
    assert axis.value(fits.time_guess_index(found, axis)) == 44  # sqrt(14 x 146) = 45.2
    assert fits.time_guess_index([], axis) == 1


@pytest.mark.unit
def test_fits_csv_has_the_timed_row(tmp_path):
    fit = fits.Fit("memory, budget chosen for the cap, step <= 1.25x tf.gradients", 48.0, "depth", 110,
                   47.1, [(110, 47.1), (116, 47.9)], time_limit=1.25, time_ratio=1.2, budget_mb=46.0,
                   probe_time_ratios={110: 1.2, 116: 1.3})
    path = tmp_path / "fits.csv"
    report.write_fits_csv([fit], str(path))
    with open(path) as f:
        (written,) = list(csv.DictReader(f))
    assert written["largest"] == "110" and written["time_limit"] == "1.25"
    assert written["time_ratio"] == "1.200" and written["budget_mb"] == "46.000"
    assert written["probe_time_ratios"] == "110:1.200;116:1.300"


@pytest.mark.slow
@pytest.mark.memory
def test_cli_repeats_and_fits_time_limit_write_their_tables(tmp_path, capsys):
    out = tmp_path / "bench"
    code = cli.main([
        "--quick", "--models", "resnet", "--depths", "8", "--variants", "tf.gradients,memory",
        "--frontier", "2", "--repeats", "2", "--steps", "4", "--cap-mb", "0.45",
        "--fits-variants", "tf.gradients", "--fits-time-limit", "1.25", "--train-steps", "0",
        "--out", str(out), "--no-progress",
    ])
    assert code == 0
    md = (out / "results.md").read_text()
    assert "## Holds in every run" in md and "Run 2 of 2:" in md
    assert "Frontier checks in each of the 2 runs" in capsys.readouterr().out
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted({r["run"] for r in rows}) == ["1", "2"] and len(rows) == 8
    assert all(float(r["cpu_spread"]) >= 0 for r in rows)
    with open(out / "fits.csv") as f:
        (plain, timed) = list(csv.DictReader(f))
    assert plain["variant"] == "tf.gradients" and timed["time_limit"] == "1.25"
    peaks = dict(p.split(":") for p in timed["probes"].split(";"))
    ratios = dict(p.split(":") for p in timed["probe_time_ratios"].split(";"))
    assert peaks and set(peaks) == set(ratios)
    for depth, mb in peaks.items():  # a probe is timed exactly when its peak fits
        assert bool(ratios[depth]) == (bool(mb) and float(mb) <= 0.45)
    if timed["largest"]:
        assert float(timed["peak_mb"]) <= 0.45 and float(timed["time_ratio"]) <= 1.25
    assert (out / "pareto.png").stat().st_size > 1000

"""The docs hold: every relative link resolves, and README's figures are the
results files' figures.

README's table of "What it saved" cites benchmark runs by a label ("sweep",
"keras") whose command names its output folder (``--out DIR``); every ratio
and MB figure in a row cited from such a run must equal, to the decimals
written, the figure of the results CSV in that folder for the same model and
variant.  A cell that lists several models or variants (``U-Net / MLP-64``)
pairs them in order with the figures (``0.49x / 0.38x``).
"""

from __future__ import annotations

import csv
import pathlib
import re

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_PATH = re.compile(r"`(\.\.?/[^`\s]+)`")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines()
            if line.startswith("#")}


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_relative_link_resolves_inside_the_repository(doc):
    text = _without_code_blocks(doc.read_text())
    broken = []
    # links resolve from the document's folder; paths in code (`./run_all_tests.sh`,
    # `../x.md`) from there or from the repository root, where commands run
    targets = [(t, [doc.parent]) for t in LINK.findall(text)]
    targets += [(t, [doc.parent, ROOT]) for t in CODE_PATH.findall(text)]
    for target, bases in targets:
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        candidates = [(base / file_part).resolve() for base in bases] if file_part else [doc]
        resolved = next((c for c in candidates if c.exists()), candidates[0])
        if ROOT not in resolved.parents and resolved != ROOT:
            broken.append(f"{target} (outside the repository)")
        elif not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.name}: {broken}"


# -- README's figures ------------------------------------------------------------------


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _results_folders(text: str) -> dict:
    """Run label -> results folder, from README's legend ('"sweep" is `... --out DIR`')."""
    folders = {}
    for label, command in re.findall(r'"(\w+)" is `([^`]*)`', text.replace("\n", " ")):
        match = re.search(r"--out\s+(\S+)", command)
        if match:
            folders[label] = ROOT / match.group(1)
    return folders


def _table_rows(text: str) -> list:
    """Rows of README's results table (the first table of ``text``), as dicts keyed by
    its header."""
    lines = []
    for line in text.splitlines():
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[-1] == "run", header
    return [dict(zip(header, [c.strip() for c in line.strip("|").split("|")]))
            for line in lines[2:]]


def _results(folder: pathlib.Path) -> list:
    (path,) = [p for p in folder.glob("*.csv") if "cpu_ratio" in p.read_text().splitlines()[0]]
    with path.open() as f:
        return list(csv.DictReader(f))


def _parts(cell: str, count: int) -> list:
    parts = [p.strip() for p in cell.split(" / ")]
    return parts * count if len(parts) == 1 else parts


def _numbers(text: str) -> set:
    return {int(n) for n in re.findall(r"\d+", text)}


def _row_matches(result: dict, model: str, path: str) -> bool:
    name = (result.get("model") or result["case"].replace("_fit", "")).replace("_", "")
    flat = re.sub(r"[^a-z0-9]", "", model.lower())
    if name not in flat:
        return False
    size, written = _numbers(result.get("size", "")), _numbers(model)
    if size and written and not (written & size):  # ResNet-110: depth=110
        return False
    return result["variant"] in re.findall(r"[a-z_]+", path.lower().replace("tf.", ""))


def _equal_to_written_decimals(written: str, value: float) -> bool:
    decimals = len(written.partition(".")[2])
    return abs(float(written) - value) <= 0.5 * 10**-decimals + 1e-9


def _cited_rows():
    text = _readme()
    folders = _results_folders(text)
    rows = _table_rows(text.split("## What it saved")[1])
    for previous, row in zip(rows, rows[1:]):
        if row["model"] == "same":
            row["model"] = previous["model"]
    return [(r, folders[r["run"]]) for r in rows if r["run"] in folders]


def test_readme_names_the_results_of_its_table():
    cited = _cited_rows()
    assert {row["run"] for row, _ in cited} >= {"sweep", "keras"}, cited
    for _, folder in cited:
        assert folder.is_dir(), folder


@pytest.mark.parametrize("row, folder", _cited_rows(), ids=lambda v: getattr(v, "name", None)
                         or (v.get("model", "")[:30] if isinstance(v, dict) else None))
def test_readme_figures_equal_the_results_file(row, folder):
    results = _results(folder)
    peak_cell = row["peak vs plain"]
    ratios = re.findall(r"([\d.]+)x", peak_cell.split("(")[0])
    times = re.findall(r"([\d.]+)x", row["time vs plain"])
    count = max(len(ratios), len(times), len(row["model"].split(" / ")), len(
        row["path"].split(" / ")))
    models, paths = _parts(row["model"], count), _parts(row["path"], count)
    ratios, times = _parts(" / ".join(ratios), count), _parts(" / ".join(times), count)
    checked = 0
    for model, path, ratio, time in zip(models, paths, ratios, times):
        matches = [r for r in results if _row_matches(r, model, path)]
        assert len(matches) == 1, (model, path, [m["variant"] for m in matches])
        (result,) = matches
        peak_ratio = float(result.get("peak_ratio") or result["alloc_ratio"])
        assert _equal_to_written_decimals(ratio, peak_ratio), (model, path, ratio, peak_ratio)
        if time:
            assert _equal_to_written_decimals(time, float(result["cpu_ratio"])), (
                model, path, time, result["cpu_ratio"])
        checked += 1
        megabytes = re.findall(r"([\d.]+) -> ([\d.]+) MB", peak_cell)
        if megabytes:
            plain = [r for r in results if r["variant"] == "tf.gradients"
                     and r["model"] == result["model"] and r["size"] == result["size"]]
            (before, after), = megabytes
            assert _equal_to_written_decimals(before, float(plain[0]["peak_mb"]))
            assert _equal_to_written_decimals(after, float(result["peak_mb"]))
    assert checked == count


def test_readme_opening_figures_are_the_tables():
    text = _readme()
    opening = text.split("## Install")[0]
    table = " ".join(" ".join(r.values()) for r in _table_rows(text.split("## What it saved")[1]))
    table_figures = [float(f) for f in re.findall(r"([\d.]+)x", table)]
    for figure in re.findall(r"([\d.]+)x", opening):
        assert any(_equal_to_written_decimals(figure, t) for t in table_figures), figure
    resnet = next(r for r in _table_rows(text.split("## What it saved")[1])
                  if "ResNet-110" in r["model"] and "memory" in r["path"])
    assert re.search(r"ResNet-110 the step peaks at ([\d.]+)x", opening).group(1) in \
        resnet["peak vs plain"]
    assert re.search(r"for ([\d.]+)x its CPU time", opening).group(1) == \
        resnet["time vs plain"].rstrip("x")

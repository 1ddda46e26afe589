"""The wheel installs the library alone: no benchmark, no test models, one version."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "memory_saving_gradients"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.unit
def test_one_package_and_one_version():
    config = _pyproject()
    assert config["tool"]["setuptools"]["packages"] == ["memory_saving_gradients"]
    assert config["project"]["dynamic"] == ["version"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "memory_saving_gradients.__version__"}
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["memory_saving_gradients"]
    assert (LIBRARY / "py.typed").exists()


@pytest.mark.unit
def test_the_library_imports_neither_the_benchmark_nor_the_test_models():
    for path in sorted(LIBRARY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("bench", "test_models", "tests"), (path, name)


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_wheel_holds_the_library_alone(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         str(ROOT), "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"memory_saving_gradients", next(t for t in tops if t.endswith(".dist-info"))}
    assert "memory_saving_gradients/py.typed" in names
    assert "memory_saving_gradients/_tensorflow.py" in names

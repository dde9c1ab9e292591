"""The core install has no engine: `kvcanary run` with no target and `kvcanary serve` say how
to get it in one line, and the package metadata keeps torch & co. in the `engine` extra."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ENGINE_DISTRIBUTIONS = ("torch", "fastapi", "uvicorn", "prometheus-client")

# Runs the CLI in a fresh interpreter in which the engine's modules cannot be found, as in
# an environment where only `pip install kvcanary` was done.
_WITHOUT_ENGINE = """
import importlib.abc, importlib.machinery, importlib.metadata, sys
HIDDEN = {"torch", "fastapi", "uvicorn", "prometheus_client"}
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        hidden = {n.replace("_", "-") for n in HIDDEN}
        for dist in importlib.machinery.PathFinder.find_distributions(context):
            if dist.metadata["Name"].lower() not in hidden:
                yield dist
sys.meta_path[:] = [
    Hide() if f is importlib.machinery.PathFinder else f for f in sys.meta_path
]
from kvcanary.harness.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _without_engine(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_ENGINE, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("args", [("run",), ("serve",)], ids=["run", "serve"])
def test_without_the_engine_extra_the_command_says_how_to_install_it(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    out = tmp_path / "out"
    extra = ("--out", str(out)) if args == ("run",) else ()
    done = _without_engine(*args, *extra, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "pip install 'kvcanary[engine]'" in lines[0]
    assert "Traceback" not in done.stderr


def test_the_core_install_has_no_engine_dependencies() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = " ".join(project["dependencies"]).lower()
    for name in ENGINE_DISTRIBUTIONS:
        assert name not in core, name
    engine = " ".join(project["optional-dependencies"]["engine"]).lower()
    assert all(name in engine for name in ENGINE_DISTRIBUTIONS)
    assert any("engine" in d for d in project["optional-dependencies"]["dev"])

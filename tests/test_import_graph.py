"""DESIGN.md's dependency rule, checked on the import graph read from the source with `ast`.

    canaries <- tenants <- harness.record <- harness -> reports -> harness.record
    reference_engine -> canaries (tokenizer, errors) only

Module-level imports of torch or reference_engine are refused on the harness side (the
harness installs without the engine extra, and the pytest plugin must load cheaply); inside
a function they are allowed, because that is how the harness starts the bundled engine.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("canaries", "tenants", "harness", "reports", "reference_engine")

ALLOWED: dict[str, tuple[str, ...]] = {
    "canaries": ("canaries",),
    "tenants": ("canaries", "tenants"),
    "harness.record": ("canaries", "tenants", "harness.record"),
    "harness": ("canaries", "tenants", "harness", "reports"),
    "reports": ("canaries", "tenants", "harness.record", "reports"),
    "reference_engine": ("canaries.errors", "canaries.tokenizer", "canaries", "reference_engine"),
}
"""Which project modules each layer may import (the most specific layer applies)."""

ENGINE_ONLY = ("torch", "reference_engine", "fastapi", "uvicorn")
"""Never imported at module level outside `reference_engine`."""


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module (`reports.render`)."""
    target: str
    """What it imports (`harness.record.events`)."""
    line: int
    top_level: bool


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(root: Path) -> Iterator[Import]:
    """Every import statement of the project's packages under `root`."""
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = _module_name(path, root)
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            top = {id(node) for node in tree.body}
            top |= {
                id(child)
                for node in tree.body
                if isinstance(node, ast.If | ast.Try)  # TYPE_CHECKING / optional imports
                for child in ast.walk(node)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    targets = [node.module]
                else:
                    continue
                for target in targets:
                    yield Import(module, target, node.lineno, id(node) in top)


def _layer(module: str) -> str:
    return "harness.record" if module.startswith("harness.record") else module.split(".")[0]


def _within(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def violations(root: Path) -> list[str]:
    """Imports that break the rule, as `module:line imports target` lines."""
    found = []
    for imp in imports_in(root):
        layer = _layer(imp.module)
        project = imp.target.split(".")[0] in PACKAGES
        lazy_engine = layer == "harness" and not imp.top_level
        allowed = (*ALLOWED[layer], "reference_engine") if lazy_engine else ALLOWED[layer]
        if project and not any(_within(imp.target, ok) for ok in allowed):
            found.append(f"{imp.module}:{imp.line} imports {imp.target} (layer {layer})")
        if (
            layer != "reference_engine"
            and imp.top_level
            and any(_within(imp.target, heavy) for heavy in ENGINE_ONLY)
        ):
            found.append(f"{imp.module}:{imp.line} imports {imp.target} at module level")
    return found


def test_the_project_follows_the_dependency_rule() -> None:
    assert violations(ROOT) == []


def test_the_graph_is_read_at_all() -> None:
    """A reader that found nothing would pass the rule vacuously."""
    found = list(imports_in(ROOT))
    assert len(found) > 300
    assert any(
        i.module == "reports.render" and i.target.startswith("harness.record") for i in found
    )


@pytest.mark.parametrize(
    ("module", "source", "broken"),
    [
        ("reports/extra.py", "import harness\n", "reports.extra:1 imports harness"),
        ("reports/extra.py", "from harness.run import runner\n", "imports harness.run"),
        ("harness/record/extra.py", "from harness.detectors import timing\n", "harness.detectors"),
        ("tenants/extra.py", "from harness.record import events\n", "imports harness.record"),
        ("canaries/extra.py", "import tenants\n", "imports tenants"),
        ("reference_engine/extra.py", "from harness.record import finding\n", "harness.record"),
        ("harness/extra.py", "import torch\n", "imports torch at module level"),
        ("reports/extra.py", "from reference_engine.config import FIXES\n", "reference_engine"),
    ],
)
def test_a_wrong_arrow_is_caught(tmp_path: Path, module: str, source: str, broken: str) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / module).write_text(source)
    assert any(broken in line for line in violations(tmp_path))


def test_a_lazy_engine_import_is_allowed(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "harness" / "wiring.py").write_text(
        "def start():\n    from reference_engine.server.launch import running_engine\n"
    )
    assert violations(tmp_path) == []

"""The dependency rule of docs/architecture.md, checked on the import graph read with `ast`.

    canaries <- tenants <- harness.record (the contract) <- harness -> reports -> harness.record
    reference_engine -> canaries (the tokenizer and errors) only

Every import counts: module level, inside a function, and a module named in a string (an
`importlib.import_module` target, a lazy-export table, a `-m` module). Module-level imports of
torch or the engine are refused on the harness side (the harness installs without the engine
extra, and the pytest plugin must load cheaply); inside a function they are allowed, because
that is how the harness starts the bundled engine. The subpackages of `harness` form no cycle,
and nothing anywhere imports the bare folder names (`harness`, `reports`, ...): the import
names are `kvcanary.*` only.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("canaries", "tenants", "harness", "reports", "reference_engine")
NAMESPACE = "kvcanary"
CONTRACT = "kvcanary.harness.record"

ALLOWED: dict[str, tuple[str, ...]] = {
    "kvcanary.canaries": ("kvcanary.canaries",),
    "kvcanary.tenants": ("kvcanary.canaries", "kvcanary.tenants"),
    CONTRACT: ("kvcanary.canaries", "kvcanary.tenants", CONTRACT),
    "kvcanary.harness": (
        "kvcanary.canaries", "kvcanary.tenants", "kvcanary.harness", "kvcanary.reports",
    ),
    "kvcanary.reports": ("kvcanary.canaries", "kvcanary.tenants", CONTRACT, "kvcanary.reports"),
    "kvcanary.reference_engine": (
        "kvcanary.canaries", "kvcanary.reference_engine",
    ),
}  # fmt: skip
"""Which project modules each layer may import (the most specific layer applies)."""

ENGINE_ONLY = ("torch", "kvcanary.reference_engine", "fastapi", "uvicorn")
"""Never imported at module level outside `reference_engine`."""

_MODULE_STRING = re.compile(rf"^{NAMESPACE}\.(?:{'|'.join(PACKAGES)})(?:\.[a-z_][a-z0-9_]*)*$")


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module (`kvcanary.reports.render`)."""
    target: str
    """What it imports (`kvcanary.harness.record.events`)."""
    line: int
    top_level: bool


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join((NAMESPACE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_in(root: Path) -> Iterator[Import]:
    """Every import of the project's packages under `root`, module names and strings included."""
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
                elif isinstance(node, ast.ImportFrom):
                    targets = [_absolute(node, module, path.name == "__init__.py")]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if not _MODULE_STRING.match(node.value):
                        continue
                    yield Import(module, node.value, node.lineno, top_level=False)
                    continue
                else:
                    continue
                for target in targets:
                    yield Import(module, target, node.lineno, id(node) in top)


def _layer(module: str) -> str:
    if _within(module, CONTRACT):
        return CONTRACT
    return ".".join(module.split(".")[:2])


def _within(target: str, prefix: str) -> bool:
    return target == prefix or target.startswith(prefix + ".")


def violations(root: Path) -> list[str]:
    """Imports that break the rule, as `module:line imports target` lines."""
    found = []
    for imp in imports_in(root):
        layer = _layer(imp.module)
        if imp.target.split(".")[0] in PACKAGES:
            found.append(f"{imp.module}:{imp.line} imports {imp.target} (not a kvcanary.* name)")
            continue
        project = _within(imp.target, NAMESPACE) and imp.target != NAMESPACE
        lazy_engine = layer == "kvcanary.harness" and not imp.top_level
        allowed = ALLOWED[layer]
        if lazy_engine:
            allowed = (*allowed, "kvcanary.reference_engine")
        if project and not any(_within(imp.target, ok) for ok in allowed):
            found.append(f"{imp.module}:{imp.line} imports {imp.target} (layer {layer})")
        if (
            layer != "kvcanary.reference_engine"
            and imp.top_level
            and any(_within(imp.target, heavy) for heavy in ENGINE_ONLY)
        ):
            found.append(f"{imp.module}:{imp.line} imports {imp.target} at module level")
    return found


def _subpackage(module: str) -> str | None:
    """`kvcanary.harness.run.session` -> `harness.run` (a top-level module is its own node)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "harness":
        return None
    return ".".join(parts[1:3])


def subpackage_cycles(root: Path) -> list[list[str]]:
    """Cycles between the subpackages of `harness` (run, cache_probe, target, ...)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports_in(root):
        src, dst = _subpackage(imp.module), _subpackage(imp.target)
        if src and dst and src != dst:
            edges[src].add(dst)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return cycles


def test_the_project_follows_the_dependency_rule() -> None:
    assert violations(ROOT) == []


def test_no_cycle_between_harness_subpackages() -> None:
    assert subpackage_cycles(ROOT) == []


def test_the_graph_is_read_at_all() -> None:
    """A reader that found nothing would pass the rule vacuously."""
    found = list(imports_in(ROOT))
    assert len(found) > 300
    assert any(i.module == "kvcanary.reports.render" and _within(i.target, CONTRACT) for i in found)
    assert any(not i.top_level for i in found)  # function-level imports are read too


def _tree(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")


@pytest.mark.parametrize(
    ("module", "source", "broken"),
    [
        ("reports/extra.py", "import harness\n", "imports harness (not a kvcanary.* name)"),
        ("reports/extra.py", "import kvcanary.harness\n", "extra:1 imports kvcanary.harness"),
        ("reports/extra.py", "from kvcanary.harness.run import runner\n", "harness.run"),
        ("reports/extra.py", "def f():\n    from kvcanary.harness.target import client\n",
         "reports.extra:2 imports kvcanary.harness.target"),
        ("reports/extra.py", "import importlib\nM = importlib.import_module("
         "'kvcanary.harness.detectors.timing')\n", "imports kvcanary.harness.detectors.timing"),
        ("reports/extra.py", "from ..harness.run import runner\n", "imports kvcanary.harness.run"),
        ("harness/record/extra.py", "from kvcanary.harness.detectors import timing\n",
         "kvcanary.harness.detectors"),
        ("tenants/extra.py", "from kvcanary.harness.record import events\n", "harness.record"),
        ("canaries/extra.py", "import kvcanary.tenants\n", "imports kvcanary.tenants"),
        ("reference_engine/extra.py", "from kvcanary.harness.record import finding\n",
         "harness.record"),
        ("harness/extra.py", "import torch\n", "imports torch at module level"),
        ("reports/extra.py", "from kvcanary.reference_engine.config import FIXES\n",
         "reference_engine"),
    ],
)  # fmt: skip
def test_a_wrong_arrow_is_caught(tmp_path: Path, module: str, source: str, broken: str) -> None:
    _tree(tmp_path)
    (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / module).write_text(source)
    assert any(broken in line for line in violations(tmp_path)), violations(tmp_path)


def test_a_lazy_engine_import_is_allowed(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / "harness" / "wiring.py").write_text(
        "def start():\n    from kvcanary.reference_engine.server.launch import running_engine\n"
    )
    assert violations(tmp_path) == []


def test_a_cycle_between_subpackages_is_caught(tmp_path: Path) -> None:
    _tree(tmp_path)
    for sub, other in (("run", "cache_probe"), ("cache_probe", "run")):
        (tmp_path / "harness" / sub).mkdir()
        (tmp_path / "harness" / sub / "__init__.py").write_text("")
        (tmp_path / "harness" / sub / "m.py").write_text(
            f"def f():\n    from kvcanary.harness.{other} import m\n"
        )
    assert subpackage_cycles(tmp_path) == [
        ["harness.cache_probe", "harness.run", "harness.cache_probe"]
    ]

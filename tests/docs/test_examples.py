"""The examples in the docs work as written: their imports resolve, their config files and
scenario files are accepted by the code that reads them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from docs_pages import README, code_blocks, pages

from kvcanary.harness.run.config import load_config_file
from kvcanary.harness.scenarios.schema import parse_scenario


def all_sources() -> dict[str, str]:
    return {**pages(), "README.md": README.read_text()}


def blocks(language: str, contains: str = "") -> list[tuple[str, str]]:
    return [
        (name, block)
        for name, text in all_sources().items()
        for block in code_blocks(text, language)
        if contains in block
    ]


def test_every_import_in_a_python_example_resolves() -> None:
    examples = blocks("python")
    assert examples
    for name, block in examples:
        tree = ast.parse(block.replace("...", "pass"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(
                        f"{node.module}.{alias.name}"
                    ), (name, node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


def test_every_config_file_example_loads(tmp_path: Path) -> None:
    examples = blocks("toml", "[run]")
    assert examples
    for index, (name, block) in enumerate(examples):
        path = tmp_path / f"{index}.toml"
        path.write_text(block)
        for command in ("run", "soak") if "[soak]" in block else ("run",):
            assert load_config_file(path, command), (name, command)


@pytest.mark.parametrize(
    ("name", "block"), blocks("toml", "[[steps]]"), ids=lambda value: str(value)[:40]
)
def test_every_scenario_example_is_valid(name: str, block: str) -> None:
    scenario = parse_scenario(block, source=name)
    assert scenario.steps

"""The reference pages cover the code and come from it: every command and option of the CLI
and the plugin appears, and the facts the code holds (scenarios, extras, the verdict table,
error kinds) are generated, never copied by hand into a page or the README."""

from __future__ import annotations

import argparse
import re
import tomllib
import typing

import docsgen
import pytest
from docs_pages import README, ROOT, pages
from docsgen.cli import arguments, subcommands
from docsgen.contract import ERROR_KIND_MEANINGS

from kvcanary.harness.cli import build_parser
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.record.judgement import verdict_table_markdown
from kvcanary.harness.record.observation import ErrorKind
from kvcanary.harness.scenarios import shipped_names

pytest_plugins = ["pytester"]


def sections(text: str) -> dict[str, str]:
    """A page's `## ` sections by heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_command_and_option_appears_in_its_commands_section(
    expanded: dict[str, str],
) -> None:
    documented = sections(expanded["reference/cli.md"])
    commands = subcommands(build_parser())
    assert commands, "kvcanary has subcommands"
    for name, parser in commands.items():
        section = documented[f"kvcanary {name}"]
        for action in arguments(parser):
            assert isinstance(action, argparse.Action)
            for spelling in action.option_strings or [action.metavar or action.dest.upper()]:
                assert f"`{spelling}" in section, (name, spelling)
            if action.help and action.help != argparse.SUPPRESS:
                first_words = " ".join(action.help.split()[:4]).split("%")[0]
                assert first_words in section.replace("\\|", "|"), (name, first_words)
    assert set(documented) >= {f"kvcanary {name}" for name in commands}
    top = build_parser()
    for action in arguments(top):
        if not isinstance(action, argparse._SubParsersAction):
            for spelling in action.option_strings:
                assert f"`{spelling}" in documented["kvcanary"], spelling


def test_the_home_page_lists_every_command(expanded: dict[str, str]) -> None:
    for name in subcommands(build_parser()):
        assert f"[`kvcanary {name}`](reference/cli.md#kvcanary-{name})" in expanded["index.md"]


def test_every_plugin_option_and_ini_key_appears(
    pytester: pytest.Pytester, expanded: dict[str, str]
) -> None:
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    help_text = pytester.runpytest("--help").stdout.str()
    flags = set(re.findall(r"^\s+(--kvcanary-[a-z-]+)", help_text, re.MULTILINE))
    keys = set(re.findall(r"^\s+(kvcanary_[a-z_]+) \(", help_text, re.MULTILINE))
    assert "--kvcanary-suite" in flags, help_text[-2000:]
    assert "kvcanary_target" in keys, help_text[-2000:]
    page = expanded["reference/pytest-plugin.md"]
    for flag in flags:
        assert f"`{flag}" in page, flag
    for key in keys:
        assert f"`{key}`" in page, key


def test_every_marker_names_a_generator_and_every_generator_is_used() -> None:
    used = {name for text in pages().values() for name in docsgen.markers(text)}
    assert used == set(docsgen.GENERATORS)
    with pytest.raises(docsgen.UnknownGenerator, match="no-such-part"):
        docsgen.expand("<!-- generate: no-such-part -->")


def test_the_scenario_list_is_the_shipped_one(
    expanded: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcanary.harness.cli import main

    assert main(["scenarios"]) == 0
    listed = re.findall(r"^(\S+)\s+(?:leak|clean)\s", capsys.readouterr().out, re.MULTILINE)
    assert listed == list(shipped_names())
    assert len(listed) >= 8
    page = expanded["reference/scenarios.md"]
    assert re.findall(r"^\| `([a-z0-9.-]+)` \|", page, re.MULTILINE) == listed
    _no_hand_copy(lambda text: [n for n in listed if re.search(rf"^\| `{n}` \|", text, re.M)])


def test_the_extras_are_pyproject_s(expanded: dict[str, str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert "ray" in extras
    rows = re.findall(
        r"^\| `kvcanary\[([a-z]+)\]` \| (.*) \| (.*) \|$", expanded["how-to/install.md"], re.M
    )
    assert [name for name, _, _ in rows] == list(extras)
    assert all(purpose != "—" for _, _, purpose in rows), "every extra says what it is for"
    _no_hand_copy(lambda text: re.findall(r"^\| `(?:kvcanary\[)?engine\]?` \|", text, re.M))


def test_the_verdict_table_is_the_code_s(expanded: dict[str, str]) -> None:
    page = expanded["reference/verdicts.md"]
    assert verdict_table_markdown() in page
    for kind in FindingKind:
        assert f"| `{kind}` | {kind.severity} | `{kind.verdict}` |" in page
    _no_hand_copy(
        lambda text: re.findall(r"^\| `[a-z_]+` \| (?:critical|high|medium|low) \|", text, re.M)
    )


def test_every_error_kind_has_its_meaning() -> None:
    assert set(ERROR_KIND_MEANINGS) == set(typing.get_args(ErrorKind))


def test_the_journal_reference_lists_every_record_type(expanded: dict[str, str]) -> None:
    from kvcanary.harness.record.events import RECORD_TYPES

    page = expanded["reference/journal.md"]
    for kind in RECORD_TYPES.values():
        assert f"### `{kind}`" in page
    assert "| `request_id` |" in sections(page)["Records"]


def _no_hand_copy(find: typing.Callable[[str], list[str]]) -> None:
    """No page source (before generation) and not the README holds rows `find` finds."""
    sources = {**pages(), "README.md": README.read_text()}
    copies = {name: hits for name, text in sources.items() if (hits := find(text))}
    assert not copies, f"hand-written copies of generated facts: {copies}"

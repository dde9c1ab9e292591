"""The pytest plugin's reference: its options and ini keys, and the built-in suite's checks.

The options are added to a parser by the same call the plugin makes in `pytest_addoption`
(`add_to_parser` over `PLUGIN_OPTIONS` with the `--kvcanary-` prefix), so their spelling,
help and defaults are the plugin's own. The checks come from the checklist and the suite
module's test functions.
"""

from __future__ import annotations

import argparse
import inspect

from docsgen.cli import arguments
from docsgen.markdown import cell, code, table
from kvcanary.harness.plugin import suite
from kvcanary.harness.plugin.checklist import CHECKS
from kvcanary.harness.plugin.pytest_plugin import INI_PREFIX, PLUGIN_OPTIONS
from kvcanary.harness.run.option_flags import add_to_parser
from kvcanary.harness.run.option_spec import PLUGIN_PREFIX


def plugin_parser() -> argparse.ArgumentParser:
    """The plugin's option group as an argparse parser, built as the plugin builds it."""
    parser = argparse.ArgumentParser(prog="pytest", add_help=False)
    add_to_parser(parser, PLUGIN_OPTIONS, prefix=PLUGIN_PREFIX)
    return parser


def plugin_options() -> str:
    """One row per plugin flag: its ini key and its help (default included)."""
    parser = plugin_parser()
    formatter = parser._get_formatter()
    rows = []
    for action in arguments(parser):
        flag = action.option_strings[0]
        key = INI_PREFIX + flag.removeprefix(PLUGIN_PREFIX).replace("-", "_")
        metavar = "" if action.nargs == 0 else f"={action.metavar}"
        help_text = formatter._expand_help(action) if action.help else ""
        rows.append((code(flag + metavar), code(key), cell(help_text)))
    return table(("option", "ini key", "meaning"), rows)


def suite_test_names() -> dict[int, str]:
    """The suite's test functions by check number (`test_3_...` is check 3)."""
    names = {}
    for name, _ in inspect.getmembers(suite, inspect.isfunction):
        number, _, rest = name.removeprefix("test_").partition("_")
        if name.startswith("test_") and number.isdigit() and rest:
            names[int(number)] = name
    return names


def suite_checks() -> str:
    """The checklist: each check's test id, what it asks, and the evidence it reads."""
    names = suite_test_names()
    rows = [
        (str(check.number), code(f"kvcanary::{names[check.number]}"), cell(check.title),
         code(check.evidence))
        for check in CHECKS
    ]  # fmt: skip
    return table(("#", "test", "asks", "evidence"), rows)

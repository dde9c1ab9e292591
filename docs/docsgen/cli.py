"""The command-line reference, read from the parsers `kvcanary` itself builds.

Every subcommand and every flag comes from `kvcanary.harness.cli.build_parser()`, the parser
the console script runs, so a new option documents itself with its help text. The option
matrix comes from the option registry (`kvcanary.harness.run.options`): which commands, config
tables and pytest flags take each setting.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Iterator

from docsgen.markdown import cell, code, table
from kvcanary.harness.cli import build_parser
from kvcanary.harness.run.option_spec import Option
from kvcanary.harness.run.options import OPTIONS

SCOPES = ("run", "soak", "audit", "repro", "plugin")


def subcommands(
    parser: argparse.ArgumentParser | None = None,
) -> dict[str, argparse.ArgumentParser]:
    """The `kvcanary` subcommands' parsers, by name, in the order `--help` lists them."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("kvcanary's parser has no subcommands")


def _summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def arguments(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """A subcommand's arguments as `--help` shows them, without `-h`."""
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            yield action


def command_list() -> str:
    """One row per subcommand: its name and one line on what it does (links are relative to
    the docs root: the home page shows this)."""
    parser = build_parser()
    summaries = _summaries(parser)
    rows = [
        (f"[`kvcanary {name}`](reference/cli.md#kvcanary-{name})", cell(summaries.get(name, "")))
        for name in subcommands(parser)
    ]
    return table(("command", "what it does"), rows)


def cli_reference() -> str:
    """`kvcanary` itself, then every subcommand: usage, description, a table of arguments."""
    parser = build_parser()
    summaries = _summaries(parser)
    own = [a for a in arguments(parser) if not isinstance(a, argparse._SubParsersAction)]
    rows = [(_spelling(a), cell(_expanded_help(parser, a))) for a in own]
    sections = [
        "## kvcanary\n",
        f"```text\n{' '.join(parser.format_usage().removeprefix('usage: ').split())}\n```\n",
        table(("argument", "meaning"), rows) if rows else "",
    ]
    for name, sub in subcommands(parser).items():
        sections.append(_command_section(name, sub, summaries.get(name, "")))
    return "\n".join(sections)


def _command_section(name: str, parser: argparse.ArgumentParser, summary: str) -> str:
    usage = " ".join(parser.format_usage().removeprefix("usage: ").split())
    parts = [f"## kvcanary {name}\n", f"{summary[:1].upper()}{summary[1:]}.\n"]
    parts.append(f"```text\n{usage}\n```\n")
    if parser.description:
        parts.append(_prose(parser, parser.description))
    rows = [(_spelling(a), cell(_expanded_help(parser, a))) for a in arguments(parser)]
    if rows:
        parts.append(table(("argument", "meaning"), rows))
    if parser.epilog:
        parts.append(_prose(parser, parser.epilog))
    return "\n".join(parts)


def _prose(parser: argparse.ArgumentParser, text: str) -> str:
    """A description or epilog: a paragraph, or as laid out where the parser keeps its layout
    (a raw formatter: tables and lists that `--help` prints as written)."""
    if isinstance(parser._get_formatter(), argparse.RawDescriptionHelpFormatter):
        return f"```text\n{textwrap.dedent(text).strip()}\n```\n"
    return " ".join(text.split()) + "\n"


def _spelling(action: argparse.Action) -> str:
    metavar = action.metavar if isinstance(action.metavar, str) else None
    if not action.option_strings:
        return code(metavar or action.dest.upper())
    if action.nargs == 0:
        return ", ".join(code(flag) for flag in action.option_strings)
    if metavar is None and action.choices is not None:
        metavar = "|".join(str(choice) for choice in action.choices)
    metavar = metavar or action.dest.upper()
    shown = f"[{metavar}]" if action.nargs == "?" else metavar
    return ", ".join(code(f"{flag} {shown}") for flag in action.option_strings)


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text with argparse's `%(default)s`-style fields filled in, as `--help` does."""
    if not action.help:
        return ""
    return parser._get_formatter()._expand_help(action)


def option_matrix() -> str:
    """Every registry option: where it is taken, its config-file key and its plugin flag."""
    rows = []
    for option in OPTIONS:
        marks = ["✓" if scope in option.scopes else "" for scope in SCOPES]
        rows.append((code(option.cli_flag), *marks, _file_key(option), _plugin_flag(option)))
    header = ("flag", *SCOPES, "config-file key", "pytest flag and ini key")
    return table(header, rows)


def _file_key(option: Option) -> str:
    return code(option.key) if option.in_file and {"run", "soak"} & set(option.scopes) else "—"


def _plugin_flag(option: Option) -> str:
    if "plugin" not in option.scopes:
        return "—"
    return f"{code(option.plugin_flag)}, {code('kvcanary_' + option.name)}"

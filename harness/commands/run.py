"""`kvcanary run` and `kvcanary soak`: parse the flags, run a session, print the verdict.

`run` is bounded by a request count (default) or a duration; with no `--target` it starts
the bundled reference engine. `soak` is the same runner for long unattended runs: bounded by
a required `--duration`, with periodic reports, journal rotation and resume from `--out`.

Both take their flags from `harness.run.options` (shared with the pytest plugin, the other
commands and the config file). This module keeps its top-level imports light so
`kvcanary --help` stays instant; the session and everything it pulls in are imported by the
handler.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcanary.harness.record.judgement import verdict_table_text
from kvcanary.harness.run.config import Command
from kvcanary.harness.run.option_flags import add_to_parser, given_values
from kvcanary.harness.run.options import options_for

_EPILOG = (
    "Exit status: 0 clean, 1 findings, 2 usage or configuration error, 3 the run could not "
    "complete (target unreachable, interrupted before a verdict). Ctrl-C stops sending and "
    "reports what was seen; a second Ctrl-C cancels requests in flight."
)

_HELP_WIDTH = 88

_DESCRIPTIONS: dict[Command, tuple[str, str]] = {
    "run": (
        "flood a target with canary-laced prompts and look for cross-tenant leaks",
        "Simulated tenants send canary-laced prompts at and above the target's KV-pool and "
        "context limits (fill, probe and abort phases); detectors flag other tenants' "
        "canaries in responses, over-limit prompts that were accepted, wrong usage counts "
        "and prefills too fast to be real. Without --target the bundled reference engine is "
        "started (vulnerable preset) on a free loopback port and stopped afterwards.",
    ),
    "soak": (
        "the same run for hours, unattended: periodic reports, journal rotation, resume",
        "Runs fill / probe / abort cycles until --duration has passed, re-rendering the "
        "report every --report-every and starting a new journal segment every "
        "--rotate-every. Pointing --out at the directory of an interrupted or crashed soak "
        "resumes it: request numbering and the journal continue.",
    ),
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `run` and `soak` subcommands."""
    for command in ("run", "soak"):
        summary, description = _DESCRIPTIONS[command]
        parser = subparsers.add_parser(
            command,
            help=summary,
            description=textwrap.fill(description, _HELP_WIDTH),
            # the verdict table is laid out by hand: a raw formatter keeps its columns
            epilog=f"{verdict_table_text(_HELP_WIDTH)}\n\n{textwrap.fill(_EPILOG, _HELP_WIDTH)}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_to_parser(parser, options_for(command))
        parser.set_defaults(handler=_handler(command))


def _handler(command: Command) -> Callable[[argparse.Namespace], int]:
    def handle(args: argparse.Namespace) -> int:
        return run_command(command, args)

    return handle


def run_command(command: Command, args: argparse.Namespace) -> int:
    """Resolve the settings, run, print the verdict and the outputs; the exit status."""
    from kvcanary.harness.run.config import resolve
    from kvcanary.harness.run.session import run_session

    flags = given_values(args, options_for(command))
    config = resolve(command, flags, flags.get("config"))
    result = run_session(config, file=sys.stderr)
    print_verdict(
        result.verdict, result.reasons, result.outcome.reason, result.outputs, result.out_dir
    )
    return result.exit_status


def print_verdict(
    verdict: str,
    reasons: tuple[str, ...] | list[Any],
    ended: str,
    outputs: dict[str, Path],
    out_dir: Path,
) -> None:
    """The verdict block `kvcanary report` prints too (`reports.verdict_block`)."""
    from kvcanary.harness.record.outputs import JOURNAL_NAME
    from kvcanary.reports.verdict_block import JOURNAL_OUTPUT, verdict_block

    journal = {JOURNAL_OUTPUT: out_dir / JOURNAL_NAME}
    print(verdict_block(verdict, reasons, ended, {**outputs, **journal}))

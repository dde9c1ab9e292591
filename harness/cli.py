"""The `kvcanary` command: a thin dispatcher over one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`handler` (a function taking the parsed namespace and returning an exit status). Modules
keep their top-level imports light (no torch, no pandas) so `kvcanary --help` is instant;
heavy imports happen inside handlers.

A usage error is one line on stderr, exit 2: what is wrong, a guess at what was meant where
one is close (`did you mean --target?`) and where the help is
(`kvcanary run: error: ...; see kvcanary run --help`), never argparse's usage block.

Exit status, for every subcommand (docs/reference/verdicts.md, "Exit codes"; mapped once in
`harness.record.verdict`): 0 clean; 1 findings; 2 usage or configuration error; 3 the run
could not complete.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvcanary import __version__
from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.record.verdict import EXIT_INCOMPLETE, EXIT_USAGE
from kvcanary.harness.run.interrupts import Delivery, sigterm_as_interrupt

_SUBCOMMAND_MODULES = (
    "kvcanary.harness.commands.run",  # run, soak
    "kvcanary.reports.command",  # report
    "kvcanary.harness.commands.audit",  # audit
    "kvcanary.harness.commands.repro",  # repro, scenarios
    "kvcanary.harness.commands.verify",  # verify
    "kvcanary.reference_engine.server.command",  # serve
)
_INVALID_CHOICE = re.compile(r"^(argument [^:]+): invalid choice: '([^']*)' \(choose from (.*)\)$")


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors; subcommand parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_reworded(message)}; see {self.prog} --help\n")

    def reject_unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """The one-line error for arguments this parser does not take, with the flags they
        may have meant."""
        flags = [flag for action in self._actions for flag in action.option_strings]
        guesses = [
            match
            for extra in extras
            if extra.startswith("-")
            for match in difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1)
        ]
        message = f"unrecognized arguments: {' '.join(extras)}"
        if guesses:
            message += f" (did you mean {' / '.join(dict.fromkeys(guesses))}?)"
        self.error(message)


def _reworded(message: str) -> str:
    """argparse's "invalid choice" with a guess, the whole list only when nothing is close."""
    invalid = _INVALID_CHOICE.match(message)
    if invalid is None:
        return message
    argument, value, listed = invalid.groups()
    choices = [choice.strip().strip("'") for choice in listed.split(",")]
    close = difflib.get_close_matches(value, choices, n=1)
    if close:
        return f"{argument}: invalid choice: {value!r} (did you mean {close[0]!r}?)"
    return f"{argument}: invalid choice: {value!r} (choose from {', '.join(choices)})"


def build_parser() -> Parser:
    parser = Parser(
        prog="kvcanary",
        description=(
            "Cross-tenant KV-cache leakage tests for LLM serving deployments. Simulated "
            "tenants send canary-laced prompts at and above the KV-pool and context limits; "
            "detectors flag other tenants' canaries in responses and prefills too fast to be "
            "real. With no --target, `kvcanary run` starts the bundled reference engine."
        ),
        epilog="Exit status: 0 clean, 1 findings, 2 usage/configuration error, 3 incomplete run.",
    )
    parser.add_argument("--version", action="version", version=f"kvcanary {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a part of the tool that is not installed
            if exc.name is not None and name.startswith(exc.name):
                continue
            raise
        module.register(subparsers)
    return parser


def parse(parser: Parser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed command line; an unknown argument is the subcommand's one-line error."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        chosen = _subparsers(parser).get(getattr(args, "command", None) or "", parser)
        chosen.reject_unrecognized(extras)
    return args


def _subparsers(parser: Parser) -> dict[str, Parser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    handler: Callable[[Any], int] = args.handler
    delivery: Delivery | None = None
    try:
        with sigterm_as_interrupt() as delivery:  # a CI job's timeout is a Ctrl-C
            return handler(args)
    except ConfigError as exc:
        print(f"kvcanary: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunIncomplete as exc:
        print(f"kvcanary: run incomplete: {exc}", file=sys.stderr)
        return EXIT_INCOMPLETE
    except KeyboardInterrupt:
        print("kvcanary: interrupted", file=sys.stderr)
        return EXIT_INCOMPLETE
    except ImportError:
        if delivery is None or not delivery.fired:
            raise
        print("kvcanary: interrupted", file=sys.stderr)  # while a C extension loaded
        return EXIT_INCOMPLETE


def entry() -> NoReturn:
    """The `kvcanary` process (the console script, `python -m kvcanary`): `main`, then exit.

    Once `main` has decided the exit status, Ctrl-C and SIGTERM (a CI job's timeout) are
    ignored: the interpreter's shutdown (full collections of a heap that holds pandas and
    matplotlib: seconds on a loaded machine) would otherwise end with the default action,
    killed by the signal (status 143), after the verdict was printed and the reports written.
    """
    status = main()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(status)


if __name__ == "__main__":
    entry()

"""The `kvcanary` command: a thin dispatcher over one module per subcommand.

Each subcommand module exposes `register(subparsers)`, which adds its parser and sets
`handler` (a function taking the parsed namespace and returning an exit status). Modules
keep their top-level imports light (no torch, no pandas) so `kvcanary --help` is instant;
heavy imports happen inside handlers.

Exit status, for every subcommand (DESIGN.md, "Run output contract"): 0 clean; 1 findings;
2 usage or configuration error; 3 the run could not complete.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.run.interrupts import Delivery, sigterm_as_interrupt

EXIT_CLEAN = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3

_SUBCOMMAND_MODULES = (
    "kvcanary.harness.commands.run",  # run, soak
    "kvcanary.reports.command",  # report
    "kvcanary.harness.commands.audit",  # audit
    "kvcanary.harness.commands.repro",  # repro, scenarios
    "kvcanary.harness.commands.verify",  # verify
    "kvcanary.reference_engine.server.command",  # serve
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcanary",
        description=(
            "Cross-tenant KV-cache leakage tests for LLM serving deployments. Simulated "
            "tenants send canary-laced prompts at and above the KV-pool and context limits; "
            "detectors flag other tenants' canaries in responses and prefills too fast to be "
            "real. With no --target, `kvcanary run` starts the bundled reference engine."
        ),
        epilog="Exit status: 0 clean, 1 findings, 2 usage/configuration error, 3 incomplete run.",
    )
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())

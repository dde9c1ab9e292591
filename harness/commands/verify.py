"""`kvcanary verify`: model-check the reference engine's PD handoff with spin, per fix switch.

Runs spin over the Promela model in `reference_engine.model_check` for the vulnerable engine,
each fix alone and all fixes together, and prints which counterexample each combination
still has: the placeholder (#30233) and the mid-transfer abort (#35049). Counterexamples are
printed as steps (`--trails`) and written as scenarios `kvcanary repro` runs against the
bundled engine (`--scenarios DIR`). The model checker is imported by the handler, so
`kvcanary --help` stays instant and needs no spin.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.record.verdict import EXIT_CLEAN, EXIT_FINDINGS

_EPILOG = (
    "Exit status: 0 the last row (all fixes, or the --fix combination) has no counterexample "
    "within the bound; 1 it has one; 2 usage error (an unknown fix, an unusable --scenarios "
    "directory); 3 spin or gcc is missing."
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `verify` subcommand."""
    parser = subparsers.add_parser(
        "verify",
        help="model-check the reference engine's PD handoff with spin, for each fix switch",
        description=(
            "Runs spin (Debian's `spin` package, with gcc) over a Promela model of the "
            "reference engine's prefill/decode handoff: bootstrap, the placeholder, the "
            "prefill capacity check, the min(src, dst) copy, Success, commit, decode reads, "
            "client aborts, page free and reuse, the in-flight write. Prints, for the "
            "vulnerable engine, each fix alone and all fixes, which counterexample remains: "
            "the placeholder (SGLang #30233) and the mid-transfer abort (#35049)."
        ),
        epilog=_EPILOG,
    )
    parser.add_argument(
        "--fix",
        action="append",
        default=[],
        metavar="NAME",
        help="check only this combination of fixes (repeatable; default: the whole table)",
    )
    parser.add_argument(
        "--trails",
        action="store_true",
        help="print each counterexample as a numbered sequence of steps",
    )
    parser.add_argument(
        "--scenarios",
        type=Path,
        metavar="DIR",
        help="write each counterexample as a scenario .toml for `kvcanary repro` into DIR",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        metavar="N",
        help="spin runs at a time (default 2)",
    )
    parser.set_defaults(handler=verify_command)


def verify_command(args: argparse.Namespace) -> int:
    """Check, print the table (and trails), write scenarios; the exit status."""
    from kvcanary.reference_engine.model_check import runner

    fixes = frozenset(args.fix)
    unknown = sorted(fixes - set(runner.MODEL_FIXES))
    if unknown:
        known = ", ".join(runner.MODEL_FIXES)
        raise ConfigError(f"--fix {unknown[0]}: the model has no such fix; known: {known}")
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    if args.scenarios is not None:
        _prepare_dir(args.scenarios)
    try:
        rows = runner.table([fixes] if args.fix else None, max_workers=args.jobs)
    except runner.ToolMissing as exc:
        raise RunIncomplete(str(exc)) from None
    print(f"PD handoff model, bound: {runner.bound_text()}")
    for line in runner.format_table(rows):
        print(f"  {line}")
    if args.trails:
        for line in runner.trail_lines(rows):
            print(line)
    if args.scenarios is not None:
        from kvcanary.reference_engine.model_check.scenario import write_scenarios

        print()
        try:
            paths = write_scenarios(rows, args.scenarios)
        except OSError as exc:
            raise ConfigError(f"--scenarios {args.scenarios}: cannot write: {exc}") from None
        for path in paths:
            print(f"scenario {path}  (kvcanary repro {path})")
    last = rows[-1]
    found = any(c.violation is not None for c in last.cells.values())
    return EXIT_FINDINGS if found else EXIT_CLEAN


def _prepare_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--scenarios {directory}: cannot create it: {exc.strerror}") from None

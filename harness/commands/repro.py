"""`kvcanary repro SCENARIO` and `kvcanary scenarios`: reproduce a written-down incident.

`repro` loads a scenario (a shipped name or a path), runs its steps against `--target`,
the scenario's own target, or its bundled engine, and prints a verdict with the evidence
bundle's path. `scenarios` lists the shipped scenarios. Top-level imports stay light so
`kvcanary --help` is instant; the run machinery is imported by the handler.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from harness.run.options import parse_env_name, parse_url

_EPILOG = (
    "Exit status: 0 reproduced (for a clean control: it stayed clean); 1 not reproduced (the "
    "expected leak did not happen, or a clean control leaked); 2 usage error (e.g. a malformed "
    "scenario, reported as FILE:LINE: FIELD: problem); 3 inconclusive (target unreachable, "
    "steps failed, interrupted)."
)
_LABELS = {"html": "report", "md": "markdown", "json": "summary", "junit": "junit"}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `repro` and `scenarios` subcommands."""
    parser = subparsers.add_parser(
        "repro",
        help="run a scenario and say whether its expected outcome was reproduced",
        description=(
            "Runs a scenario's ordered steps (victims, probes, disconnects, waits) against "
            "--target, the scenario's own target, or the bundled reference engine the "
            "scenario describes, then compares the findings with the scenario's expected "
            "outcome. The run directory holds the evidence: journal.jsonl, report.html, "
            "report.md, summary.json, junit.xml and evidence/."
        ),
        epilog=_EPILOG,
    )
    parser.add_argument(
        "scenario",
        metavar="SCENARIO",
        help="a shipped scenario's name (see `kvcanary scenarios`) or a scenario .toml file",
    )
    parser.add_argument(
        "--target",
        type=_checked(parse_url),
        metavar="URL",
        help="run against this deployment instead of the scenario's target or engine",
    )
    parser.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a parameter the scenario declares (repeatable), e.g. "
        "--param pool_tokens=284928",
    )
    parser.add_argument(
        "--out", metavar="DIR", help="run directory (default ./kvcanary-runs/<UTC timestamp>)"
    )
    parser.add_argument(
        "--api-key-env",
        type=_checked(parse_env_name),
        metavar="VAR",
        help="environment variable holding the API key, for every tenant (the key itself is "
        "never written anywhere)",
    )
    parser.add_argument(
        "--keep-raw-evidence",
        action="store_true",
        help="keep response text verbatim in the journal and evidence (default: redacted to "
        "canary spans plus a hash)",
    )
    parser.set_defaults(handler=repro_command)
    listing = subparsers.add_parser(
        "scenarios",
        help="list the shipped scenarios",
        description="Lists the scenarios shipped with kvcanary: name, expected outcome, "
        "what each reproduces, and the parameters it takes.",
    )
    listing.set_defaults(handler=scenarios_command)


def repro_command(args: argparse.Namespace) -> int:
    """Load, run, print the verdict and the evidence paths; the exit status."""
    from harness.scenarios.repro import run_repro
    from harness.scenarios.schema import parse_param_assignment, resolve_scenario

    params = dict(parse_param_assignment(text) for text in args.param)
    scenario = resolve_scenario(args.scenario, params)
    print(f"scenario {scenario.name} ({scenario.source})")
    print(f"  expects  {scenario.expect.describe()}")
    result = run_repro(
        scenario,
        target=args.target,
        out=args.out,
        api_key_env=args.api_key_env,
        keep_raw_evidence=args.keep_raw_evidence,
        file=sys.stderr,
    )
    print(f"verdict: {result.verdict.upper()} - {'; '.join(result.reasons)}")
    if result.out_dir is None:
        print("  evidence  none: nothing was sent")
        return result.exit_status
    print(f"  run dir   {result.out_dir}")
    for name, path in (*result.outputs.items(), ("journal", result.out_dir / "journal.jsonl")):
        print(f"  {_LABELS.get(name, name):<9} {path}")
    return result.exit_status


def scenarios_command(args: argparse.Namespace) -> int:
    """Print every shipped scenario: name, expected outcome, one line, parameters."""
    from harness.scenarios import shipped_names
    from harness.scenarios.schema import resolve_scenario

    scenarios = [resolve_scenario(name) for name in shipped_names()]
    width = max(len(s.name) for s in scenarios)
    print(f"{'NAME':<{width}}  {'EXPECTS':<7}  DESCRIPTION")
    for scenario in scenarios:
        print(f"{scenario.name:<{width}}  {scenario.expect.outcome:<7}  {scenario.summary}")
        if scenario.params:
            names = " ".join(f"{p.name}={p.default}" for p in scenario.params)
            print(f"{'':<{width}}  {'':<7}  params: {names}")
    print("\nRun one with `kvcanary repro NAME`; a path to a .toml file works too.")
    return 0


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert

"""`kvcanary repro SCENARIO` and `kvcanary scenarios`: reproduce a written-down incident.

`repro` loads a scenario (a shipped name or a path), runs its steps against `--target`,
the scenario's own target, or its bundled engine, and prints a verdict with the evidence
bundle's path. `scenarios` lists the shipped scenarios. Top-level imports stay light so
`kvcanary --help` is instant; the run machinery is imported by the handler.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvcanary.harness.record.outputs import EVIDENCE_DIR, JOURNAL_NAME, REPORT_FILES
from kvcanary.harness.run.option_flags import add_to_parser, given_values
from kvcanary.harness.run.options import options_for

if TYPE_CHECKING:
    from kvcanary.harness.run.config import Layer
    from kvcanary.harness.scenarios.schema import Scenario

_EPILOG = (
    "Exit status: 0 reproduced (for a clean control: it stayed clean); 1 not reproduced (the "
    "expected leak did not happen, or a clean control leaked); 2 usage error (e.g. a malformed "
    "scenario, reported as FILE:LINE: FIELD: problem); 3 inconclusive (target unreachable, "
    "steps failed, interrupted)."
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `repro` and `scenarios` subcommands."""
    parser = subparsers.add_parser(
        "repro",
        help="run a scenario and say whether its expected outcome was reproduced",
        description=(
            "Runs a scenario's ordered steps (victims, probes, disconnects, waits) against "
            "--target, the scenario's own target, or the bundled reference engine the "
            "scenario describes, then compares the findings with the scenario's expected "
            "outcome. The run directory holds the evidence: "
            f"{', '.join((JOURNAL_NAME, *REPORT_FILES.values()))} and {EVIDENCE_DIR}/."
        ),
        epilog=_EPILOG,
    )
    parser.add_argument(
        "scenario",
        metavar="SCENARIO",
        help="a shipped scenario's name (see `kvcanary scenarios`) or a scenario .toml file",
    )
    add_to_parser(parser, options_for("repro"))
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
    from kvcanary.harness.run.config import Layer, settings
    from kvcanary.harness.scenarios.repro import run_repro
    from kvcanary.harness.scenarios.schema import parse_param_assignment, resolve_scenario

    flags = given_values(args, options_for("repro"))
    params = dict(parse_param_assignment(text) for text in flags.get("param", ()))
    scenario = resolve_scenario(args.scenario, params)
    options = settings("repro", scenario_layer(scenario), Layer("the command line", flags))
    print(f"scenario {scenario.name} ({scenario.source})")
    print(f"  expects  {scenario.expect.describe()}")
    result = run_repro(
        scenario,
        target=options["target"],
        out=options["out"],
        api_key_env=options["api_key_env"],
        keep_raw_evidence=options["keep_raw_evidence"],
        file=sys.stderr,
    )
    print(f"verdict: {result.verdict.upper()} - {'; '.join(result.reasons)}")
    if result.out_dir is None:
        print("  evidence  none: nothing was sent")
        return result.exit_status
    print(f"  run dir   {result.out_dir}")
    from kvcanary.reports.verdict_block import JOURNAL_OUTPUT, OUTPUT_LABELS

    journal = (JOURNAL_OUTPUT, result.out_dir / JOURNAL_NAME)
    for name, path in (*result.outputs.items(), journal):
        print(f"  {OUTPUT_LABELS.get(name, name):<9} {path}")
    return result.exit_status


def scenarios_command(args: argparse.Namespace) -> int:
    """Print every shipped scenario: name, expected outcome, one line, parameters."""
    from kvcanary.harness.scenarios import shipped_names
    from kvcanary.harness.scenarios.schema import resolve_scenario

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


def scenario_layer(scenario: Scenario) -> Layer:
    """The settings a scenario gives, by option name, for `harness.run.config.merge`: above a
    config file, below the command line."""
    from kvcanary.harness.run.config import Layer

    engine = scenario.engine
    values = {
        "target": scenario.target,
        "seed": scenario.seed,
        "model": scenario.client.model,
        "tokenizer": scenario.client.tokenizer,
        "timeout": scenario.client.timeout_s,
        "tenants": len(scenario.tenants.names),
        "engine_preset": engine.preset if engine is not None else None,
        "engine_fix": engine.fixes if engine is not None else None,
    }
    given = {name: value for name, value in values.items() if value is not None}
    return Layer(f"scenario {scenario.source}", given)

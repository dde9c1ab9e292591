"""Facts about the project that live in its files: extras, shipped scenarios, workload
profiles, and what a default run sends.

The extras are read from `pyproject.toml` (with the comment above each), the scenarios from
the shipped `.toml` files as `kvcanary scenarios` reads them, the profiles from
`kvcanary.tenants.workload`, and a default run's size from the cost guard's own count of the
plans the run will send.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

from docsgen.markdown import cell, code, table
from kvcanary.harness.record.events import Limits
from kvcanary.harness.run.config import DEFAULT_CONCURRENCY, DEFAULT_NUM_REQUESTS
from kvcanary.harness.run.cost_guard import plan_totals
from kvcanary.harness.run.option_values import format_duration
from kvcanary.harness.run.options import OPTIONS_BY_NAME
from kvcanary.harness.run.phases import default_phases
from kvcanary.harness.scenarios import shipped_names
from kvcanary.harness.scenarios.schema import Scenario, resolve_scenario
from kvcanary.tenants.cost import PlanTotals
from kvcanary.tenants.workload import PROFILES, get_profile

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
EXAMPLE_CONTEXTS = (4_096, 32_768, 131_072, 1_048_576)
"""Context lengths (pool = context) the default run's size is shown for."""


def extra_comments(text: str) -> dict[str, str]:
    """The comment lines directly above each `name = [` of the optional-dependencies table."""
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in section.splitlines():
        if line.startswith("#"):
            pending.append(line.lstrip("# ").strip())
            continue
        match = re.match(r"([a-z0-9_-]+)\s*=\s*\[", line)
        if match:
            comments[match.group(1)] = " ".join(pending)
        pending = []
    return comments


def extras() -> str:
    """Every optional extra of the distribution: what it installs and what it is for."""
    text = PYPROJECT.read_text()
    table_data = tomllib.loads(text)["project"]["optional-dependencies"]
    comments = extra_comments(text)
    rows = []
    for name, requirements in table_data.items():
        names = [re.split(r"[<>=!~ ;]", req, maxsplit=1)[0] for req in requirements]
        brings = ", ".join(code(n) for n in names)
        rows.append((code(f"kvcanary[{name}]"), brings, cell(comments.get(name, ""))))
    return table(("extra", "brings", "for"), rows)


def shipped_scenarios() -> list[Scenario]:
    """The shipped scenarios, validated, in `kvcanary scenarios` order."""
    return [resolve_scenario(name) for name in shipped_names()]


def scenarios() -> str:
    """One row per shipped scenario: where it runs, what it expects, what it shows."""
    rows = []
    for scenario in shipped_scenarios():
        rows.append(
            (
                code(scenario.name),
                cell(_runs_on(scenario)),
                cell(scenario.expect.describe()),
                cell(" ".join(scenario.description.split())),
            )
        )
    return table(("name", "runs on", "expects", "what it shows"), rows)


def _runs_on(scenario: Scenario) -> str:
    if scenario.engine is not None:
        fixes = f" + {', '.join(scenario.engine.fixes)}" if scenario.engine.fixes else ""
        return f"the bundled engine, `{scenario.engine.preset}`{fixes}"
    if scenario.target is not None:
        return scenario.target
    params = ", ".join(f"`{p.name}`" for p in scenario.params)
    return f"`--target URL` (required); params {params}" if params else "`--target URL`"


def profiles() -> str:
    """The workload profiles: their sizes, as expressions over the target's limits."""
    rows = []
    for profile in PROFILES.values():
        rows.append(
            (
                code(profile.name),
                cell(profile.description),
                ", ".join(code(s.expr) for s in profile.victims) or "—",
                ", ".join(code(s.expr) for s in profile.probes) or "—",
                ", ".join(code(s.expr) for s in profile.aborts) or "—",
                f"{profile.victim_max_tokens} / {profile.probe_max_tokens}",
            )
        )
    header = ("profile", "what it is", "victims", "probes", "aborts", "max_tokens victim / probe")
    return table(header, rows)


def default_totals(context_tokens: int) -> PlanTotals:
    """What the default `kvcanary run` plans against a target whose pool equals its context."""
    profile = get_profile(str(OPTIONS_BY_NAME["profile"].default))
    limits = Limits(context_tokens, context_tokens, 16, "example")
    phases = default_phases(profile.victim_fraction)
    api = OPTIONS_BY_NAME["api"].default
    return plan_totals(profile, limits, api, num_requests=DEFAULT_NUM_REQUESTS, phases=phases)


def default_run() -> str:
    """A default run's size: requests, prompt and completion tokens at a few context lengths."""
    rows = []
    for context in EXAMPLE_CONTEXTS:
        totals = default_totals(context)
        rows.append(
            (
                f"{context:,}",
                f"{totals.num_requests:,}",
                f"{totals.num_prompt_tokens:,}",
                f"{totals.num_prompt_tokens / context:.1f} × the context",
                f"{totals.num_completion_tokens:,}",
            )
        )
    header = ("context (= pool)", "requests", "prompt tokens", "that is", "completion tokens")
    timeout = format_duration(OPTIONS_BY_NAME["timeout"].default)
    intro = (
        f"The defaults: `--profile {OPTIONS_BY_NAME['profile'].default}`, "
        f"`--requests {DEFAULT_NUM_REQUESTS}`, `--concurrency {DEFAULT_CONCURRENCY}` against a "
        f"`--target`, `--tenants {OPTIONS_BY_NAME['tenants'].default}`, "
        f"`--timeout {timeout}` per request. The plans, counted as the cost guard counts them "
        "(every prompt, also those a safe target must reject, and every answer at its "
        "`max_tokens`):\n\n"
    )
    rounds = math.ceil(DEFAULT_NUM_REQUESTS / DEFAULT_CONCURRENCY)
    bound = format_duration(rounds * OPTIONS_BY_NAME["timeout"].default)
    outro = (
        f"\n{DEFAULT_CONCURRENCY} requests are in flight at a time, so a default run is about "
        f"{rounds} rounds of prefills of up to the context length; each request is bounded by "
        f"`--timeout`, so the requests end within {rounds} × {timeout} = {bound}, after "
        "discovery and calibration.\n"
    )
    return intro + table(header, rows) + outro

"""Judging a reproduction: what each step did, and the verdict against the scenario.

`reproduced` when the expectation was met (for a `clean` control: no finding and every step
did its job), `not reproduced` when the run did its job and the outcome differs (an expected
finding kind is missing, a forbidden one appeared, a clean control leaked), `inconclusive`
when the target could not be reached or steps failed in a way that could hide the outcome
(transport errors, no victim accepted, an isolation check that could not judge, interrupted).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvcanary.harness.record.verdict import Reproduction, Verdict
from kvcanary.harness.run.runner import RunOutcome
from kvcanary.harness.scenarios.schema import CacheProbeStep, Expectation, Scenario, SendStep, Step

FAILURES = ("connect", "timeout", "protocol", "truncated", "too_large", "cancelled")
"""Error kinds that mean a request did not do its job (rejections and intended drops do)."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one step sent and saw."""

    number: int
    step: Step
    num_requests: int = 0
    num_ok: int = 0
    errors: Mapping[str, int] = field(default_factory=dict)
    """Observations by error kind (`http_status` is a rejection, `disconnected` a drop)."""
    findings: Mapping[str, int] = field(default_factory=dict)
    ended: str = "completed"
    probe_verdict: str | None = None
    """A cache_probe step's verdict: `leak`, `unsafe`, `clean` or `inconclusive`."""
    probe_reasons: tuple[str, ...] = ()

    @classmethod
    def of(cls, number: int, step: Step, outcome: RunOutcome) -> StepReport:
        return cls(
            number=number,
            step=step,
            num_requests=outcome.num_requests,
            num_ok=outcome.num_observations - sum(outcome.errors.values()),
            errors=dict(outcome.errors),
            findings=dict(outcome.findings),
            ended=outcome.reason,
        )

    @property
    def label(self) -> str:
        return f"step {self.number} ({self.step.name})"


@dataclass(frozen=True, slots=True)
class ReproResult:
    """A reproduction's verdict, why, and where its evidence is."""

    scenario: Scenario
    verdict: Reproduction
    reasons: tuple[str, ...]
    out_dir: Path | None
    """The evidence bundle; None when nothing was sent (target unreachable)."""
    target: str | None = None
    findings: Mapping[str, int] = field(default_factory=dict)
    steps: tuple[StepReport, ...] = ()
    outputs: Mapping[str, Path] = field(default_factory=dict)
    render_errors: Mapping[str, str] = field(default_factory=dict)

    @property
    def exit_status(self) -> int:
        """0 reproduced, 1 not reproduced, 3 inconclusive (2 is a usage error, raised)."""
        return self.verdict.exit_status


# -- the verdict -----------------------------------------------------------------------


def judge(
    expect: Expectation, findings: Mapping[str, int], steps: Sequence[StepReport], ended: str
) -> tuple[Reproduction, tuple[str, ...]]:
    """Compare what a run found with what its scenario expects."""
    found = {kind: n for kind, n in findings.items() if n}
    problems = _problems(steps, ended)
    num_requests = sum(s.num_requests for s in steps)
    if expect.outcome == Verdict.CLEAN:
        if found:
            return Reproduction.NOT_REPRODUCED, (f"the clean control leaked: {_counts(found)}",)
        if problems:
            return Reproduction.INCONCLUSIVE, problems
        return Reproduction.REPRODUCED, (
            f"clean as expected: no finding in {num_requests} request(s)",
        )
    forbidden = [kind for kind in expect.must_not_include if kind in found]
    if forbidden:
        return Reproduction.NOT_REPRODUCED, (
            f"found {', '.join(forbidden)}, which the scenario says must not appear "
            f"(all findings: {_counts(found)})",
        )
    missing = [str(kind) for kind in expect.must_include if kind not in found]
    if not expect.must_include and not found:
        missing = ["any"]
    if not missing:
        return Reproduction.REPRODUCED, (f"expected leak seen: {_counts(found)}",)
    absent = f"no {' / '.join(missing)} finding in {num_requests} request(s)"
    if found:
        absent += f" (found only {_counts(found)})"
    if problems:
        return Reproduction.INCONCLUSIVE, (absent, *problems)
    return Reproduction.NOT_REPRODUCED, (f"the expected leak did not happen: {absent}",)


def _problems(steps: Sequence[StepReport], ended: str) -> tuple[str, ...]:
    """Why a step may not have done its job."""
    problems = []
    if ended != "completed":
        problems.append(f"the run ended early ({ended}) after {len(steps)} step(s)")
    for report in steps:
        step = report.step
        if isinstance(step, CacheProbeStep) and report.probe_verdict == Verdict.INCONCLUSIVE:
            problems.append(f"{report.label}: isolation unverifiable: {report.probe_reasons[0]}")
        if not isinstance(step, SendStep):
            continue
        failed = {kind: n for kind, n in report.errors.items() if kind in FAILURES}
        if failed:
            problems.append(
                f"{report.label}: {sum(failed.values())} of {report.num_requests} request(s) "
                f"failed ({_counts(failed)})"
            )
        if step.kind == "victims" and report.num_requests and report.num_ok == 0:
            problems.append(f"{report.label}: no victim was accepted, so nothing could leak")
    return tuple(problems)


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))

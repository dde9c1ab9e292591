"""Run events: what the journal records, one JSON object per line.

Producers (runner, detectors) emit these; consumers (journal writer, progress display,
reports) read them. Each record is `{"type": <event type>, ...fields}`. Reports are a pure
function of a sequence of these records, so this module is the journal's schema: add fields
with defaults, never change the meaning of an existing one.

Credentials never appear here: tenants are recorded by name and by the *name* of the
environment variable that holds their key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvcanary.canaries.span import CanarySpan
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.observation import Observation, Usage
from kvcanary.tenants.plan import RequestPlan

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class Limits:
    """The target's limits the workload was sized against, and where each came from."""

    pool_tokens: int
    context_tokens: int
    page_size: int
    source: str
    """`flags`, `sglang:/get_server_info`, `openai:/v1/models`, `engine`, ..."""
    max_input_tokens: int | None = None
    """The target's own input limit (SGLang max_req_input_len), where it reports one."""


@dataclass(frozen=True, slots=True)
class RunStarted:
    """A run began: its target, limits, tenants and settings (no credential values)."""

    run_id: str
    target: str
    model: str
    api: str
    limits: Limits
    tenants: tuple[dict[str, Any], ...]
    seed: int
    canary_key_id: str
    """Public fingerprint of the run's canary key; the key itself is not journaled."""
    canaries: dict[str, Any] = field(default_factory=dict)
    """The canary alphabet (`alphabet_id`, `size`, `word_tokens`), `num_words`, and the page
    guarantee (`guaranteed_window`, `per_page`, `guarantee`; see `canaries.guarantee`)."""
    settings: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    t_wall: float = 0.0
    schema: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class PhaseStarted:
    """The runner moved to a new phase (`fill`, `probe`, `abort`, `cache_probe`, ...)."""

    phase: str
    t_wall: float


@dataclass(frozen=True, slots=True)
class PlanRecorded:
    """A request was planned (written before it is sent)."""

    plan: RequestPlan


@dataclass(frozen=True, slots=True)
class ObservationRecorded:
    """A request finished (successfully or not) and this is what was seen."""

    observation: Observation


@dataclass(frozen=True, slots=True)
class FindingRecorded:
    """A detector reported a finding."""

    finding: Finding
    t_wall: float


@dataclass(frozen=True, slots=True)
class OwnEchoRecorded:
    """A response held canary-shaped markers recombined from its own prompt: echoes, no
    finding (`harness.detectors.own_echo`); the markers' words are all the request's own."""

    request_id: str
    tenant: str
    num_markers: int
    markers: tuple[str, ...]
    """The first few markers, canonical form."""
    t_wall: float


@dataclass(frozen=True, slots=True)
class ProbeFinished:
    """An opt-in probe phase reached its own verdict (a `harness.record.verdict.Verdict`:
    `leak`, `clean` or `inconclusive`), with its statistics; findings are recorded apart."""

    probe: str
    verdict: str
    details: dict[str, Any]
    t_wall: float


@dataclass(frozen=True, slots=True)
class TimingFitted:
    """The timing detector's TTFT model changed (a refit, or the final fit at the end of a
    run); reports and checks draw and apply the last one, exactly as the detector did."""

    model: dict[str, Any] | None
    """`TtftModel.to_dict()`, or None when there were too few samples to fit."""
    t_wall: float
    final: bool = False
    """Written after the run's last request: the fit every deferred judgement used."""
    not_judged: str | None = None
    """Why timing could not judge the answers so far (no fit, every prompt too short for
    the rule); None when it could. Reports and check 6 say "not judged" with this reason."""


@dataclass(frozen=True, slots=True)
class TargetUnhealthy:
    """The target stopped serving: `num_failed` requests in a row got a 5xx or failed at the
    connection after it had served requests (`harness.run.health`)."""

    t_wall: float
    """When the run declared it (the `num_failed`-th failure in a row finished)."""
    since_t_wall: float
    """When the first failure of the run of failures was sent."""
    num_failed: int
    num_served_before: int
    """Requests the target had answered (any HTTP status below 500) before it stopped."""
    first_request_id: str
    """The first failed request ("" when the health route saw it before any request)."""
    last_error: str | None
    source: str = "requests"
    """What showed it: `requests` (failed requests in a row) or `health` (the target's
    `/health` route failed, `harness.target.health_route`)."""


@dataclass(frozen=True, slots=True)
class TargetServing:
    """A target declared unhealthy answered again; `num_failed` requests failed meanwhile."""

    t_wall: float
    num_failed: int


@dataclass(frozen=True, slots=True)
class RunFinished:
    """The run ended; `reason` is `completed`, `interrupted`, `duration`, `budget_spent`
    (the cost guard's budget) or `error`."""

    reason: str
    t_wall: float
    num_requests: int
    message: str | None = None


Event = (
    PhaseStarted
    | PlanRecorded
    | ObservationRecorded
    | FindingRecorded
    | OwnEchoRecorded
    | RunStarted
    | RunFinished
    | ProbeFinished
    | TimingFitted
    | TargetUnhealthy
    | TargetServing
)

_TYPE_OF: dict[type, str] = {
    RunStarted: "run_started",
    PhaseStarted: "phase",
    PlanRecorded: "plan",
    ObservationRecorded: "observation",
    FindingRecorded: "finding",
    OwnEchoRecorded: "own_echo",
    RunFinished: "run_finished",
    ProbeFinished: "probe_finished",
    TimingFitted: "timing_fitted",
    TargetUnhealthy: "target_unhealthy",
    TargetServing: "target_serving",
}


def to_record(event: Event) -> dict[str, Any]:
    """The JSON-ready dict for one event. Plans are journaled without their prompt text."""
    kind = _TYPE_OF[type(event)]
    if isinstance(event, PlanRecorded):
        body = dataclasses.asdict(event.plan)
        body.pop("prompt")
        body["canaries"] = [dataclasses.asdict(c) for c in event.plan.canaries]
        return {"type": kind, **body}
    if isinstance(event, ObservationRecorded):
        return {"type": kind, **dataclasses.asdict(event.observation)}
    if isinstance(event, FindingRecorded):
        body = dataclasses.asdict(event.finding)
        body["kind"] = str(event.finding.kind)
        body["severity"] = str(event.finding.severity)
        return {"type": kind, "t_wall": event.t_wall, **body}
    return {"type": kind, **dataclasses.asdict(event)}


def from_record(record: dict[str, Any]) -> Event:
    """Rebuild an event from its journal record (the inverse of `to_record`)."""
    body = dict(record)
    kind = body.pop("type")
    if kind == "plan":
        body["canaries"] = tuple(CanarySpan(**c) for c in body.get("canaries", ()))
        return PlanRecorded(RequestPlan(prompt="", **body))
    if kind == "observation":
        body["usage"] = Usage(**(body.get("usage") or {}))
        return ObservationRecorded(Observation(**body))
    if kind == "finding":
        t_wall = body.pop("t_wall")
        body["kind"] = FindingKind(body["kind"])
        body["severity"] = Severity(body["severity"])
        if body.get("offsets") is not None:
            body["offsets"] = tuple(body["offsets"])
        return FindingRecorded(Finding(**body), t_wall=t_wall)
    if kind == "own_echo":
        body["markers"] = tuple(body["markers"])
        return OwnEchoRecorded(**body)
    if kind == "run_started":
        body["limits"] = Limits(**body["limits"])
        body["tenants"] = tuple(body["tenants"])
        return RunStarted(**body)
    if kind == "phase":
        return PhaseStarted(**body)
    if kind == "run_finished":
        return RunFinished(**body)
    if kind == "probe_finished":
        return ProbeFinished(**body)
    if kind == "timing_fitted":
        return TimingFitted(**body)
    if kind == "target_unhealthy":
        return TargetUnhealthy(**body)
    if kind == "target_serving":
        return TargetServing(**body)
    raise ValueError(f"unknown journal record type {kind!r}")

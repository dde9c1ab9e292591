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

from kvcanary.harness.record.decoding import RecordError, build, convert
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.record.plan_line import PlanLine, plan_of, plan_record
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
    max_tokens_policy: str | None = None
    """What the engine does with a prompt that fits the context when prompt + max_tokens
    does not: `reject` (vLLM, SGLang, OpenAI: HTTP 400) or `stop` (llama.cpp: it answers
    until the context is full); None where unknown (`harness.target.engine_shapes`)."""


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
    """What showed it: `requests` (failed requests in a row) or `health` (requests that
    timed out while the target's `/health` route failed too: they stopped completing)."""


@dataclass(frozen=True, slots=True)
class HealthRouteFailed:
    """The target's `/health` route failed `num_polls` polls in a row while the run went on.
    Recorded, not judged: whether the target serves is decided by its requests
    (`harness.run.health`); a route slow under load is common (llama.cpp's)."""

    t_wall: float
    since_t_wall: float
    """When the first failed poll of the run of failures was made."""
    num_polls: int
    last_error: str
    num_served_since: int = 0
    """Requests answered while the route was failing, up to `t_wall`."""


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
    | HealthRouteFailed
)

RECORD_TYPES: dict[type, str] = {
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
    HealthRouteFailed: "health_route_failed",
}
"""Each event's record `type`, the first key of its journal line."""
_EVENT_OF = {name: event_type for event_type, name in RECORD_TYPES.items()}
PLAN_RECORD = RECORD_TYPES[PlanRecorded]
OBSERVATION_RECORD = RECORD_TYPES[ObservationRecorded]
RECORD_BODIES: dict[str, type] = {PLAN_RECORD: PlanLine, OBSERVATION_RECORD: Observation}
"""The dataclass whose fields are a request record's body (a plan's: `plan_line.PlanLine`,
without its prompt, its canaries packed); `request_id`, their first field, follows `type`
in every such line."""
assert all(dataclasses.fields(body)[0].name == "request_id" for body in RECORD_BODIES.values())


def to_record(event: Event) -> dict[str, Any]:
    """The JSON-ready dict for one event. Plans are journaled without their prompt text and
    with their canaries packed (`plan_line`). Built field by field (`plain`), not with
    `dataclasses.asdict`, which deep-copies everything it meets."""
    kind = RECORD_TYPES[type(event)]
    if isinstance(event, PlanRecorded):
        return {"type": kind, **plan_record(event.plan)}
    if isinstance(event, ObservationRecorded):
        return {"type": kind, **plain(event.observation)}
    if isinstance(event, FindingRecorded):
        body = plain(event.finding)
        body["kind"] = str(event.finding.kind)
        body["severity"] = str(event.finding.severity)
        return {"type": kind, "t_wall": event.t_wall, **body}
    return {"type": kind, **plain(event)}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_ATOMS = (str, int, float, bool, type(None))


def plain(value: Any) -> Any:
    """`value` with every dataclass in it a dict of its fields (what `asdict` gives), lists
    and dicts copied only where they hold one: a journal record's values, built once."""
    if isinstance(value, _ATOMS):
        return value
    kind = type(value)
    names = _FIELD_NAMES.get(kind)
    if names is None and dataclasses.is_dataclass(value):
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(kind))
    if names is not None:
        return {name: plain(getattr(value, name)) for name in names}
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


def from_record(record: dict[str, Any], unknown: set[str] | None = None) -> Event:
    """Rebuild an event from its journal record (the inverse of `to_record`).

    Every value is checked against its declaration (`harness.record.decoding`): a record
    that does not match raises `RecordError`. Fields this version does not declare are
    dropped and their dotted names added to `unknown`: the record is kept.
    """
    unknown = set() if unknown is None else unknown
    body = dict(record)
    kind = body.pop("type", None)
    event_type = _EVENT_OF.get(kind) if isinstance(kind, str) else None
    if event_type is None:
        raise RecordError(f"unknown record type {str(kind)[:40]!r} (from a newer kvcanary?)")
    if event_type is PlanRecorded:
        return PlanRecorded(plan_of(build(PlanLine, body, kind, unknown)))
    if event_type is ObservationRecorded:
        return ObservationRecorded(build(Observation, body, kind, unknown))
    if event_type is FindingRecorded:
        t_wall = convert(float, body.pop("t_wall", None), f"{kind}.t_wall", unknown)
        return FindingRecorded(build(Finding, body, kind, unknown), t_wall=t_wall)
    event: Event = build(event_type, body, kind, unknown)
    return event

"""`summary.json`: the run's verdict, counts and metadata, computed from its frames.

The verdict is the verdict table's (`harness.record.judgement.judge`) applied to the run's
findings and to what this module finds could not be judged:

- the target stopped serving (`target_unhealthy`);
- the run ended with an error;
- no above-limit request (a plan with `expected = reject`) was answered with any HTTP status
  (a run whose probes were all planned within the limits tests leakage within the limits,
  and says so, rather than nothing);
- no victim request was accepted, so there was nothing to leak;
- an opt-in probe (the cache probe) could not reach a decision.

A run interrupted (or killed) after enough was judged still has a verdict: what it saw
counts. The table's `leak` and decisive `unsafe` findings outweigh what could not be judged.

Metadata is copied from the journal's run start through allow-lists (tenant names and the
*names* of their key variables, settings whose names do not look secret, the target URL
without user-info or query): the journal holds no credential, and this module makes sure a
report cannot grow one. It never reads the environment.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime
from importlib import metadata
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvcanary.harness.record.events import ProbeFinished, TargetServing, TargetUnhealthy
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.record.judgement import Judgement, judge
from kvcanary.harness.record.outputs import SUMMARY_SCHEMA, Summary
from kvcanary.harness.record.verdict import Verdict
from kvcanary.reports.checks import check_states
from kvcanary.reports.frames import OUTCOMES, RunFrames
from kvcanary.reports.leaks import leak_matrix
from kvcanary.reports.remedies import what_to_do
from kvcanary.reports.spent import spent
from kvcanary.reports.ttft import journaled_ttft

_SCALARS = (bool, int, float, str, type(None))
_SECRET_NAME = re.compile(r"key|token|secret|passw|auth|cookie|credential|header", re.IGNORECASE)


def compute_summary(frames: RunFrames) -> Summary:
    """The `summary.json` document for a run (JSON-ready; keys are stable)."""
    run, finished = frames.run, frames.finished
    evidence = _evidence(frames)
    judgement = _judgement(frames, evidence)
    started = run.t_wall if run is not None else None
    ended = finished.t_wall if finished is not None else _last_time(frames)
    summary = Summary(
        schema=SUMMARY_SCHEMA,
        run_id=run.run_id if run is not None else None,
        verdict=str(judgement.verdict),
        verdict_reasons=list(judgement.reasons),
        target=safe_target(run.target) if run is not None else None,
        model=run.model if run is not None else None,
        api=run.api if run is not None else None,
        limits=dataclasses.asdict(run.limits) if run is not None else None,
        seed=run.seed if run is not None else None,
        canary_key_id=run.canary_key_id if run is not None else None,
        canaries=dict(run.canaries) if run is not None else {},
        tenants=safe_tenants(run.tenants) if run is not None else [],
        settings=safe_settings(run.settings) if run is not None else {},
        versions={**(run.versions if run is not None else {}), "kvcanary_report": _version()},
        times={
            "started": _iso(started),
            "finished": _iso(ended),
            "duration_s": round(ended - started, 3) if started and ended else None,
        },
        finished={
            "reason": finished.reason if finished is not None else None,
            "message": finished.message if finished is not None else None,
            "num_requests_reported": finished.num_requests if finished is not None else None,
        },
        phases=[phase.phase for phase in frames.phases],
        probes=[_probe_record(probe) for probe in frames.probes],
        checks_not_run=_checks_not_run(frames),
        timing=_timing(frames),
        boundary=_boundary(frames),
        target_unhealthy=_target_unhealthy(frames),
        leaks=_leaks(frames, started),
        counts=_counts(frames),
        evidence=evidence,
        spent=spent(frames),
        checks={},
        what_to_do=what_to_do(frames.findings),
    )
    summary["checks"] = {
        check.kind: {"status": check.status, "num_findings": check.num_findings, "why": check.why}
        for check in check_states(summary)
    }
    return summary


def _counts(frames: RunFrames) -> dict[str, Any]:
    requests, findings = frames.requests, frames.findings
    by_kind = findings["kind"].value_counts()
    outcome_counts = requests["outcome"].value_counts()
    return {
        "requests": {
            "total": len(requests),
            **{outcome: int(outcome_counts.get(outcome, 0)) for outcome in OUTCOMES},
        },
        "requests_by_intent": _value_counts(requests["intent"]),
        "findings": {str(kind): int(by_kind.get(str(kind), 0)) for kind in FindingKind},
        "findings_total": len(findings),
        "findings_by_severity": _value_counts(findings["severity"]),
    }


def _evidence(frames: RunFrames) -> dict[str, Any]:
    requests = frames.requests
    above_limit = requests["expected"] == "reject"
    return {
        "num_above_limit_sent": int(above_limit.sum()),
        "num_above_limit_answered": int((above_limit & requests["status"].notna()).sum()),
        "num_victims_accepted": int(((requests["intent"] == "victim") & requests["ok"]).sum()),
        "num_probes_sent": int((requests["intent"] == "probe").sum()),
        "reached_probe_phase": bool(
            any(phase.phase == "probe" for phase in frames.phases)
            or (requests["intent"] == "probe").any()
        ),
    }


def _judgement(frames: RunFrames, evidence: dict[str, Any]) -> Judgement:
    """The verdict table applied to the run's findings and what it could not judge."""
    findings = frames.findings
    facts = zip(
        findings["kind"].astype(str),
        findings["request_id"].astype(object).where(findings["request_id"].notna(), None),
        strict=True,
    )
    unhealthy = _unhealthy_reason(frames)
    return judge(
        facts,
        [*unhealthy, *_not_judged(frames, evidence)],
        remarks=unhealthy,
        clean_reason=_clean_reason(frames, evidence),
    )


def _within_limits_only(evidence: dict[str, Any]) -> bool:
    """Probes were sent and none was sized above a limit: the profile plans none (`below`)."""
    return bool(evidence["num_probes_sent"] > 0 and evidence["num_above_limit_sent"] == 0)


def _not_judged(frames: RunFrames, evidence: dict[str, Any]) -> list[str]:
    """Why parts of what the run planned could not be judged (beside the target's health)."""
    reasons = []
    finished = frames.finished
    if finished is not None and finished.reason == "error":
        reasons.append(f"the run ended with an error: {finished.message or 'no message'}")
    if evidence["num_above_limit_answered"] == 0 and not _within_limits_only(evidence):
        if not evidence["reached_probe_phase"]:
            reasons.append("the run ended before the probe phase: no above-limit request was sent")
        else:
            reasons.append("no above-limit request was answered by the target")
    if evidence["num_victims_accepted"] == 0:
        reasons.append("no victim request was accepted, so there was nothing to leak")
    for probe in frames.probes:
        if probe.verdict == Verdict.INCONCLUSIVE:
            why = "; ".join(str(r) for r in _probe_record(probe)["reasons"] or ()) or "no reason"
            reasons.append(f"the {probe.probe.replace('_', ' ')} could not reach a decision: {why}")
    return reasons


def _clean_reason(frames: RunFrames, evidence: dict[str, Any]) -> str:
    if _within_limits_only(evidence):
        return (
            f"no finding in {len(frames.requests)} request(s), every one within the limits "
            f"({evidence['num_victims_accepted']} victim request(s) accepted); no prompt above "
            "a limit was planned, so over-limit handling was not tested"
        )
    return (
        f"no finding in {len(frames.requests)} request(s); "
        f"{evidence['num_above_limit_answered']} above-limit request(s) answered, "
        f"{evidence['num_victims_accepted']} victim request(s) accepted"
    )


def _target_unhealthy(frames: RunFrames) -> dict[str, Any] | None:
    """When the target stopped serving (the first time), and whether it came back."""
    declared = [e for e in frames.health if isinstance(e, TargetUnhealthy)]
    if not declared:
        return None
    first = declared[0]
    served_again = [e for e in frames.health if isinstance(e, TargetServing)]
    failed_after = requests_failed_since(frames, first.since_t_wall)
    return {
        "at": _iso(first.t_wall),
        "since": _iso(first.since_t_wall),
        "first_request_id": first.first_request_id,
        "num_served_before": first.num_served_before,
        "num_failed": max(first.num_failed, failed_after),
        "last_error": first.last_error,
        "source": first.source,
        "times_declared": len(declared),
        "recovered": len(served_again) >= len(declared),
    }


def requests_failed_since(frames: RunFrames, t_wall: float) -> int:
    """Requests sent from `t_wall` on that got a 5xx or no status at all."""
    requests = frames.requests
    if requests.empty or "t_wall" not in requests:
        return 0
    later = requests.loc[requests["t_wall"] >= t_wall]
    failed = later["status"].isna() | (later["status"] >= 500)
    return int(failed.sum())


def _unhealthy_reason(frames: RunFrames) -> list[str]:
    entry = _target_unhealthy(frames)
    if entry is None:
        return []
    back = "; it answered again later" if entry["recovered"] else ""
    why = f" ({entry['last_error']})" if entry["last_error"] else ""
    return [
        f"the target stopped serving after {entry['num_served_before']} answered request(s): "
        f"{entry['num_failed']} failed{why}{back}; what was sent while it was down tested "
        "nothing"
    ]


def safe_target(url: str) -> str:
    """The target URL without user-info, query or fragment (where credentials hide)."""
    parts = urlsplit(url)
    if not parts.netloc:
        return url.split("?", 1)[0]
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def safe_tenants(tenants: tuple[dict[str, Any], ...]) -> list[dict[str, str | None]]:
    """Each tenant's name and the names (never the values) of its environment variables."""
    safe = []
    for tenant in tenants:
        entry: dict[str, str | None] = {"name": str(tenant.get("name"))}
        for field, value in tenant.items():
            if field.endswith("_env") and (value is None or isinstance(value, str)):
                entry[field] = value
        safe.append(entry)
    return safe


def safe_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Plain settings (scalars, lists of scalars) whose names cannot hold a secret: names that
    look like keys, tokens, passwords or headers are dropped unless they name a variable."""
    safe: dict[str, Any] = {}
    for name, value in settings.items():
        if _SECRET_NAME.search(name) and not name.endswith("_env"):
            continue
        if isinstance(value, list | tuple) and all(isinstance(v, _SCALARS) for v in value):
            safe[name] = list(value)
        elif isinstance(value, _SCALARS):
            safe[name] = value
    return safe


def _value_counts(column: Any) -> dict[str, int]:
    return {str(value): int(count) for value, count in column.value_counts().items()}


def _last_time(frames: RunFrames) -> float | None:
    times = frames.requests["t_wall"].dropna()
    return float(times.max()) if len(times) else None


def _iso(t_wall: float | None) -> str | None:
    if t_wall is None:
        return None
    try:
        return datetime.fromtimestamp(t_wall, UTC).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):  # a journal's time no calendar holds
        return None


def _version() -> str:
    try:
        return metadata.version("kvcanary")
    except metadata.PackageNotFoundError:
        return "unknown"


def _probe_record(probe: ProbeFinished) -> dict[str, Any]:
    assessment = probe.details.get("assessment", {})
    return {"probe": probe.probe, "verdict": probe.verdict, "reasons": assessment.get("reasons")}


def _timing(frames: RunFrames) -> dict[str, Any]:
    """The timing detector's journaled model (the line reports draw and checks apply).

    Plain fields the detector journals besides its model (whether the fit was final, and
    where it writes them, whether it judged and why not) are copied as they are.
    """
    model, note = journaled_ttft(frames)
    entry: dict[str, Any] = {"model": model.to_dict() if model is not None else None}
    if frames.timing is not None:
        for field in dataclasses.fields(frames.timing):
            value = getattr(frames.timing, field.name)
            if field.name not in ("model", "t_wall") and isinstance(value, _SCALARS):
                entry[field.name] = value
    entry["note"] = note
    if model is not None:  # the prompts the rule applied to: none means nothing was judged
        requests = frames.requests
        eligible = requests["num_prompt_tokens"].astype("float64") >= model.min_eligible_tokens
        entry["num_judged"] = int((eligible & requests["ttft_ms"].notna()).sum())
    reason = entry.get("not_judged")
    if model is None and not reason:
        reason = "no TTFT fit: too few answered prompts of distinct lengths"
    elif model is not None and not reason and entry.get("num_judged") == 0:
        reason = (
            f"no answered prompt was long enough for the rule (it applies from "
            f"{model.min_eligible_tokens:.0f} tokens)"
        )
    entry["judged"] = not reason
    entry["reason"] = reason or None
    return entry


def _boundary(frames: RunFrames) -> dict[str, Any]:
    """Prompts exactly at the tightest limit (`expected = boundary`): what the target did.

    Either answer is defensible, so this is reported, never a finding by itself: `accepted`
    (a 2xx answer), `rejected` (an error status, or an error inside a 2xx), `unanswered`.
    """
    requests = frames.requests
    at = requests.loc[requests["expected"] == "boundary"]
    status = at["status"]
    success = status.notna() & (status >= 200) & (status < 300)
    in_success = at["error_kind"] == "error_in_success"
    accepted = success & ~in_success
    sizes = sorted({int(n) for n in at["num_prompt_tokens"]})
    return {
        "num_sent": len(at),
        "accepted": int(accepted.sum()),
        "rejected": int((status.notna() & ~accepted).sum()),
        "unanswered": int(status.isna().sum()),
        "num_prompt_tokens": sizes,
    }


def _leaks(frames: RunFrames, started: float | None) -> dict[str, Any]:
    tenants = [str(t.get("name")) for t in frames.run.tenants] if frames.run is not None else []
    matrix = leak_matrix(frames.findings, tenants, started)
    matrix["first"] = _iso(matrix.pop("first_t_wall"))
    return matrix


def _checks_not_run(frames: RunFrames) -> dict[str, str]:
    """Finding kinds this run could not have produced, with why: absent is not clean.

    A run audits no pool sizes (that is `kvcanary audit`), and finds a shared prefix cache (or
    a cache salt not bound to its tenant) only with its opt-in probe, whose `unverifiable`
    verdict proves nothing either way.
    """
    found = set(frames.findings["kind"])
    reasons: dict[str, str] = {}
    if str(FindingKind.POOL_SMALLER_THAN_CONTEXT) not in found:
        reasons[str(FindingKind.POOL_SMALLER_THAN_CONTEXT)] = (
            "pool sizes are audited by `kvcanary audit`, not by a run"
        )
    requests = frames.requests
    if str(FindingKind.UNSAFE_ACCEPT) not in found and not (requests["expected"] == "reject").any():
        reasons[str(FindingKind.UNSAFE_ACCEPT)] = (
            "no prompt above a limit was sent (the profile plans none, or the run ended first)"
        )
    cache = [p for p in frames.probes if p.probe == "cache_probe"]
    for kind in (FindingKind.SHARED_PREFIX_CACHE, FindingKind.CACHE_SALT_NOT_BOUND):
        if str(kind) in found:
            continue
        if not cache:
            reasons[str(kind)] = "the cache probe did not run (opt in with --cache-probe)"
        elif all(p.verdict == Verdict.INCONCLUSIVE for p in cache):
            reasons[str(kind)] = (
                "the cache probe was unverifiable: its positive control saw no cache"
            )
    return reasons

"""`summary.json`: the run's verdict, counts and metadata, computed from its frames.

Verdict rules (the one place they live; README "Reports" repeats them):

- `leak`: the journal holds at least one finding of a kind other than `error_in_success`.
- `unsafe`: the only findings are `error_in_success` (HTTP 2xx carrying an error: a protocol
  defect, not a leak) and the evidence below would otherwise make the run clean; with too
  little evidence the run is `inconclusive`, its reasons naming those findings.
- `clean`: no finding, and enough evidence that the dangerous path was exercised: at least
  one above-limit request (a plan with `expected = reject`) was answered by the target with
  any HTTP status, at least one victim request was accepted, and the run did not end with
  an error. A run interrupted (or killed) after that point is still clean: what it saw
  counts.
- `inconclusive`: everything else: the run was interrupted before the probe phase, the
  target became unreachable, every request errored, no victim got through.

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
from kvcanary.harness.record.verdict import Verdict
from kvcanary.reports.checks import check_states
from kvcanary.reports.frames import OUTCOMES, RunFrames
from kvcanary.reports.leaks import leak_matrix
from kvcanary.reports.ttft import journaled_ttft
from kvcanary.tenants.cost import PlanTotals, Prices

SUMMARY_SCHEMA = 1
_SCALARS = (bool, int, float, str, type(None))
_SECRET_NAME = re.compile(r"key|token|secret|passw|auth|cookie|credential|header", re.IGNORECASE)


def compute_summary(frames: RunFrames) -> dict[str, Any]:
    """The `summary.json` document for a run (JSON-ready; keys are stable)."""
    requests, findings = frames.requests, frames.findings
    run, finished = frames.run, frames.finished
    evidence = _evidence(frames)
    verdict, reasons = _verdict(frames, evidence)
    by_kind = findings["kind"].value_counts()
    outcome_counts = requests["outcome"].value_counts()
    started = run.t_wall if run is not None else None
    ended = finished.t_wall if finished is not None else _last_time(frames)
    summary = {
        "schema": SUMMARY_SCHEMA,
        "run_id": run.run_id if run is not None else None,
        "verdict": str(verdict),
        "verdict_reasons": reasons,
        "target": safe_target(run.target) if run is not None else None,
        "model": run.model if run is not None else None,
        "api": run.api if run is not None else None,
        "limits": dataclasses.asdict(run.limits) if run is not None else None,
        "seed": run.seed if run is not None else None,
        "canary_key_id": run.canary_key_id if run is not None else None,
        "canaries": dict(run.canaries) if run is not None else {},
        "tenants": safe_tenants(run.tenants) if run is not None else [],
        "settings": safe_settings(run.settings) if run is not None else {},
        "versions": {
            **(run.versions if run is not None else {}),
            "kvcanary_report": _report_version(),
        },
        "times": {
            "started": _iso(started),
            "finished": _iso(ended),
            "duration_s": round(ended - started, 3) if started and ended else None,
        },
        "finished": {
            "reason": finished.reason if finished is not None else None,
            "message": finished.message if finished is not None else None,
            "num_requests_reported": finished.num_requests if finished is not None else None,
        },
        "phases": [phase.phase for phase in frames.phases],
        "probes": [_probe_record(probe) for probe in frames.probes],
        "checks_not_run": _checks_not_run(frames),
        "timing": _timing(frames),
        "boundary": _boundary(frames),
        "target_unhealthy": _target_unhealthy(frames),
        "leaks": _leaks(frames, started),
        "counts": {
            "requests": {
                "total": len(requests),
                **{outcome: int(outcome_counts.get(outcome, 0)) for outcome in OUTCOMES},
            },
            "requests_by_intent": _value_counts(requests["intent"]),
            "findings": {str(kind): int(by_kind.get(str(kind), 0)) for kind in FindingKind},
            "findings_total": len(findings),
            "findings_by_severity": _value_counts(findings["severity"]),
        },
        "evidence": evidence,
        "spent": _spent(frames),
    }
    summary["checks"] = {
        check.kind: {"status": check.status, "num_findings": check.num_findings, "why": check.why}
        for check in check_states(summary)
    }
    return summary


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


def _verdict(frames: RunFrames, evidence: dict[str, Any]) -> tuple[Verdict, list[str]]:
    """The verdict and, for a person, why."""
    in_success = frames.findings["kind"].astype(str) == str(FindingKind.ERROR_IN_SUCCESS)
    num_findings = int((~in_success).sum())
    if num_findings:
        by_kind = frames.findings["kind"].astype(str).value_counts()
        kinds = ", ".join(
            _kind_count(str(kind), int(num))
            for kind, num in sorted(by_kind.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        leak = [f"{num_findings} finding(s): {kinds}"]
        return Verdict.LEAK, [*leak, *_unhealthy_reason(frames)]
    finished = frames.finished
    reasons = _unhealthy_reason(frames)
    num_in_success = int(in_success.sum())
    in_success_reason = (
        f"{num_in_success} error_in_success finding(s): HTTP 2xx carrying an error instead of "
        "an answer (a protocol defect, not a leak)"
    )
    if finished is not None and finished.reason == "error":
        reasons.append(f"the run ended with an error: {finished.message or 'no message'}")
    # probes were sent and none was sized above a limit: the profile plans none (`below`),
    # so the run tests leakage within the limits only, and says so, rather than nothing
    within_limits_only = evidence["num_probes_sent"] > 0 and evidence["num_above_limit_sent"] == 0
    if evidence["num_above_limit_answered"] == 0 and not within_limits_only:
        if not evidence["reached_probe_phase"]:
            reasons.append("the run ended before the probe phase: no above-limit request was sent")
        else:
            reasons.append("no above-limit request was answered by the target")
    if evidence["num_victims_accepted"] == 0:
        reasons.append("no victim request was accepted, so there was nothing to leak")
    if reasons:
        return Verdict.INCONCLUSIVE, [*reasons, *([in_success_reason] if num_in_success else [])]
    if num_in_success:
        return Verdict.UNSAFE, [in_success_reason]
    if within_limits_only:
        return Verdict.CLEAN, [
            f"no finding in {len(frames.requests)} request(s), every one within the limits "
            f"({evidence['num_victims_accepted']} victim request(s) accepted); no prompt above "
            "a limit was planned, so over-limit handling was not tested"
        ]
    return Verdict.CLEAN, [
        f"no finding in {len(frames.requests)} request(s); "
        f"{evidence['num_above_limit_answered']} above-limit request(s) answered, "
        f"{evidence['num_victims_accepted']} victim request(s) accepted"
    ]


def _kind_count(kind: str, num: int) -> str:
    """`2 cross_tenant_canary (a leak from another tenant)`: what each leak kind means."""
    meaning = FindingKind(kind).leak if kind in FindingKind.__members__.values() else None
    return f"{num} {kind}" + (f" ({meaning})" if meaning else "")


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


def _spent(frames: RunFrames) -> dict[str, Any]:
    """What the run sent, counted as the cost guard counts (`tenants.cost`: every planned
    prompt token, completions at their `max_tokens`), beside what the target reported."""
    requests = frames.requests
    planned = PlanTotals(
        num_requests=len(requests),
        num_prompt_tokens=int(requests["num_prompt_tokens"].sum()),
        num_completion_tokens=int(requests["max_tokens"].sum()),
    )
    settings = frames.run.settings if frames.run is not None else {}
    prices = settings.get("price_per_mtok")
    priced = Prices(*prices) if isinstance(prices, list | tuple) and len(prices) == 2 else None
    reported_prompt = int(requests["prompt_tokens"].sum())
    reported_completion = int(requests["completion_tokens"].sum())
    return {
        **planned.to_dict(priced),
        "num_prompt_tokens_reported": reported_prompt,
        "num_completion_tokens_reported": reported_completion,
        "cost_reported": round(priced.cost(reported_prompt, reported_completion), 6)
        if priced is not None
        else None,
        "budget": {
            name: settings.get(name)
            for name in ("max_requests", "max_prompt_tokens", "max_cost", "price_per_mtok")
        },
    }


def _value_counts(column: Any) -> dict[str, int]:
    return {str(value): int(count) for value, count in column.value_counts().items()}


def _last_time(frames: RunFrames) -> float | None:
    times = frames.requests["t_wall"].dropna()
    return float(times.max()) if len(times) else None


def _iso(t_wall: float | None) -> str | None:
    if t_wall is None:
        return None
    return datetime.fromtimestamp(t_wall, UTC).isoformat(timespec="seconds")


def _report_version() -> str:
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

    A run audits no pool sizes (that is `kvcanary audit`), and finds a shared prefix cache
    only with its opt-in probe, whose `unverifiable` verdict proves nothing either way.
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
    if str(FindingKind.SHARED_PREFIX_CACHE) not in found:
        if not cache:
            reasons[str(FindingKind.SHARED_PREFIX_CACHE)] = (
                "the cache probe did not run (opt in with --cache-probe)"
            )
        elif all(p.verdict == "inconclusive" for p in cache):
            reasons[str(FindingKind.SHARED_PREFIX_CACHE)] = (
                "the cache probe was unverifiable: its positive control saw no cache"
            )
    return reasons

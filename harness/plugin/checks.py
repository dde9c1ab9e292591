"""The built-in check suite: the incident checklist as nine separate pass/fail decisions.

Each check reads one piece of shared evidence and decides. The suite makes up to four pieces
of evidence per target and every check that needs one reads the same one:

    incident   one run of the `incident` profile (fill / probe / abort), one request at a time
               on the bundled engine so TTFT stays clean: checks 1, 2, 3, 5, 6 and 7
    below      one run of the `below` profile with several requests in flight: check 4
    audit      the pool-versus-context audit (`harness.target.audit`): check 8
    cache_probe  opt-in (`--kvcanary-cache-probe`): a short `below` run, then the
               cross-tenant prefix-cache timing probe (`harness.cache_probe.probe`): check 9

The detectors are the judges; a check selects the findings that answer its question and
looks at the requests table only to know whether the run sent what the question needs. A
check ends in one of three ways:

    passed    the evidence is there and shows no problem
    failed    the findings that show the problem, or "inconclusive": the run did not send
              the traffic the check needs (too few requests, every request errored)
    skipped   the target cannot be judged this way (no `usage` at all, TTFT noise larger
              than a prefill, a pool it does not report); the reason says which

What it deliberately does not do: run anything, print, or know about pytest. Running is
`harness.plugin.target`, reporting is `harness.plugin.suite` and the plugin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import pandas as pd

from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.record.verdict import Verdict

if TYPE_CHECKING:
    from kvcanary.harness.plugin.target import WorkloadResult
    from kvcanary.harness.target.audit import AuditResult

Status = Literal["passed", "failed", "skipped"]
Evidence = Literal["incident", "below", "audit", "cache_probe"]

LEAK_KINDS = (FindingKind.CROSS_TENANT_CANARY,)
"""What "another tenant's canary" means for checks 3 and 4: a canary attributed to another
tenant of this run. An `unknown_canary` (a canary shape no key of this run minted, e.g. from
an earlier run against the same target) names no tenant; it stays in the run's findings and
summary but does not decide these checks."""
ABORT_LEAK_KINDS = (FindingKind.CROSS_TENANT_CANARY, FindingKind.CROSS_REQUEST_CANARY)
"""An aborted request's canary in a later response is a leak whoever sent that response."""


@dataclass(frozen=True, slots=True)
class CheckOutcome:
    """How one check ended, and the evidence a person needs to act on a failure."""

    status: Status
    reason: str
    """One line: why it passed, failed or was skipped."""
    findings: tuple[Finding, ...] = ()
    requests: pd.DataFrame | None = None
    """The requests table of the run judged (to describe the requests findings name)."""
    out_dir: Path | None = None
    request_ids: tuple[str, ...] = ()
    """Requests a failure without findings is about (shown like a finding's request)."""


# -- the decisions -------------------------------------------------------------------------


def _passed(reason: str, run: WorkloadResult) -> CheckOutcome:
    return CheckOutcome("passed", reason, requests=run.observations, out_dir=run.out_dir)


def _failed(reason: str, run: WorkloadResult, findings: Iterable[Finding] = ()) -> CheckOutcome:
    return CheckOutcome(
        "failed", reason, tuple(findings), requests=run.observations, out_dir=run.out_dir
    )


def _skipped(reason: str, run: WorkloadResult) -> CheckOutcome:
    return CheckOutcome("skipped", reason, requests=run.observations, out_dir=run.out_dir)


def _findings(
    run: WorkloadResult, kinds: Sequence[FindingKind], request_ids: Iterable[str] | None = None
) -> list[Finding]:
    wanted = None if request_ids is None else set(request_ids)
    return [
        f for f in run.findings if f.kind in kinds and (wanted is None or f.request_id in wanted)
    ]


def _answered(requests: pd.DataFrame) -> pd.DataFrame:
    return requests.loc[requests["status"].notna()]


def _accepted(requests: pd.DataFrame) -> pd.DataFrame:
    return requests.loc[requests["status"].between(200, 299).fillna(False).astype(bool)]


def _errors(requests: pd.DataFrame) -> str:
    counts = requests["error_kind"].value_counts()
    return ", ".join(f"{kind} {n}" for kind, n in counts.items() if n) or "no error recorded"


def _limit(run: WorkloadResult, name: str) -> int | None:
    limits = run.summary.get("limits") or {}
    value = limits.get(name)
    return int(value) if value else None


def _rejects_at(run: WorkloadResult, name: str, what: str) -> CheckOutcome:
    """Every prompt that exceeds the `name` limit was refused, not answered.

    A prompt exactly at the limit is a boundary probe (`tenants.size`: either answer is
    defensible) and is not held to this check; summary.json's `boundary` says what the target
    did with it. A 2xx status carrying an error (`error_in_success`) is a refusal in the wrong
    status: it is its own finding, not an answer.
    """
    limit = _limit(run, name)
    if limit is None:
        return _failed(f"inconclusive: the run recorded no {what} size", run)
    requests = run.observations
    over = requests.loc[requests["num_prompt_tokens"] > limit]
    if over.empty:
        return _failed(
            f"inconclusive: no prompt above the {what} ({limit} tokens) was sent; "
            "give the run more requests (--kvcanary-requests)",
            run,
        )
    answered = _answered(over)
    if answered.empty:
        return _failed(
            f"inconclusive: none of the {len(over)} prompt(s) above the {what} "
            f"({limit} tokens) got an HTTP status ({_errors(over)})",
            run,
        )
    accepted = _accepted(answered)
    accepted = accepted.loc[accepted["error_kind"] != "error_in_success"]
    if not accepted.empty:
        statuses = ", ".join(sorted({str(int(s)) for s in accepted["status"]}))
        return _failed(
            f"{len(accepted)} of {len(answered)} prompt(s) above the {what} "
            f"({limit} tokens) got HTTP {statuses} instead of an error",
            run,
            _findings(run, (FindingKind.UNSAFE_ACCEPT,), accepted["request_id"]),
        )
    return _passed(
        f"all {len(answered)} prompt(s) above the {what} ({limit} tokens) were rejected",
        run,
    )


def over_pool_rejected(run: WorkloadResult) -> CheckOutcome:
    return _rejects_at(run, "pool_tokens", "KV pool")


def over_context_rejected(run: WorkloadResult) -> CheckOutcome:
    return _rejects_at(run, "context_tokens", "context length")


def no_leak_at_or_above_limits(run: WorkloadResult) -> CheckOutcome:
    requests = run.observations
    above = requests.loc[requests["expected"].isin(("reject", "boundary"))]
    if above.empty:
        return _failed("inconclusive: no prompt at or above the limits was sent", run)
    leaks = _findings(run, LEAK_KINDS, above["request_id"])
    if leaks:
        return _failed(_leak_reason(leaks, "at or above the limits"), run, leaks)
    num_answered = len(_accepted(above))
    return _passed(
        f"no other tenant's canary in {len(above)} request(s) at or above the limits "
        f"({num_answered} answered)",
        run,
    )


def no_leak_below_limits(run: WorkloadResult) -> CheckOutcome:
    requests = run.observations
    below = _accepted(requests.loc[requests["expected"] == "accept"])
    if below.empty:
        return _failed(
            f"inconclusive: no request below the limits was answered ({_errors(requests)})", run
        )
    leaks = _findings(run, LEAK_KINDS, below["request_id"])
    workers = run.summary.get("settings", {}).get("concurrency")
    load = f" with {workers} request(s) in flight" if workers else ""
    if leaks:
        return _failed(_leak_reason(leaks, f"below the limits{load}"), run, leaks)
    return _passed(
        f"no other tenant's canary in {len(below)} answer(s) below the limits{load}", run
    )


def usage_matches(run: WorkloadResult) -> CheckOutcome:
    requests = run.observations
    reported = _accepted(requests).loc[lambda r: r["prompt_tokens"].notna()]
    if reported.empty:
        return _skipped(
            "the target reported no usage.prompt_tokens in any answer; nothing to compare", run
        )
    mismatches = _findings(run, (FindingKind.PROMPT_TOKENS_MISMATCH,))
    if mismatches:
        wrong = reported.loc[reported["prompt_tokens"] != reported["num_prompt_tokens"]]
        pairs = sorted(
            set(
                zip(
                    wrong["num_prompt_tokens"].astype(int),
                    wrong["prompt_tokens"].astype(int),
                    strict=True,
                )
            )
        )
        shown = ", ".join(f"{sent} sent -> {said}" for sent, said in pairs[:6])
        return _failed(
            f"usage.prompt_tokens differed from the tokens sent in {len(mismatches)} of "
            f"{len(reported)} answer(s): {shown}",
            run,
            mismatches,
        )
    sizes = reported["num_prompt_tokens"]
    return _passed(
        f"usage.prompt_tokens matched in all {len(reported)} answer(s), "
        f"{sizes.nunique()} size(s) from {int(sizes.min())} to {int(sizes.max())} tokens",
        run,
    )


def real_prefill(run: WorkloadResult) -> CheckOutcome:
    """No `fast_prefill` finding, and the largest accepted prompt above the detector's bar.

    The largest accepted prompt, the one the incident skipped, is held to the detector's own
    rule (`TtftModel.threshold`, where `TtftModel.eligible` says the rule can judge it).
    Where it cannot (no fit, or noise hides the prefill of every answered prompt) the check
    is skipped as "not judged" with the detector's reason: it never passes without a bar
    that an answer with no prefill would fall under.
    """
    from kvcanary.harness.record.ttft_model import TtftModel

    requests = run.observations
    timed = _accepted(requests).loc[lambda r: r["ttft_ms"].notna()]
    if timed.empty:
        return _failed(f"inconclusive: no answer had a first token ({_errors(requests)})", run)
    n_max = int(timed["num_prompt_tokens"].max())
    at_max = timed.loc[timed["num_prompt_tokens"] == n_max].sort_values("ttft_ms")
    fastest_id, fastest_ms = str(at_max["request_id"].iloc[0]), float(at_max["ttft_ms"].iloc[0])
    largest = f"the largest accepted prompt ({n_max} tokens, {fastest_id})"
    fast = _findings(run, (FindingKind.FAST_PREFILL,))
    fitted = (run.summary.get("timing") or {}).get("model")
    model = TtftModel.from_dict(fitted) if fitted else None
    if fast:
        expected = f"; a real prefill takes about {model.predict(n_max):.0f} ms" if model else ""
        return _failed(
            f"{len(fast)} answer(s) came faster than a real prefill allows; {largest} got "
            f"its first token after {fastest_ms:.0f} ms{expected}",
            run,
            fast,
        )
    timing = run.summary.get("timing") or {}
    if model is None:
        why = timing.get("not_judged") or "too few answered prompts of distinct lengths to fit"
        return _skipped(f"not judged: {why}", run)
    if timing.get("judged") is False or timing.get("not_judged"):
        why = timing.get("not_judged") or timing.get("reason") or "the detector could not judge"
        return _skipped(f"not judged: {why}", run)
    bar_ms = model.threshold(n_max)
    if not model.eligible(n_max):
        return _skipped(f"not judged: {model.why_unjudged(n_max)} ({largest})", run)
    if bar_ms <= 0:
        return _skipped(
            f"not judged: the bar for {largest} is {bar_ms:.0f} ms, and no answer comes "
            "faster than that",
            run,
        )
    summary = (
        f"{largest} got its first token after {fastest_ms:.0f} ms; a real prefill takes about "
        f"{model.predict(n_max):.0f} ms, and an answer under {bar_ms:.0f} ms skipped at least "
        "half of it"
    )
    if fastest_ms < bar_ms:
        failed = _failed(f"{summary}: it was not prefilled", run)
        return dataclasses.replace(failed, request_ids=(fastest_id,))
    return _passed(summary, run)


def no_leak_after_disconnect(run: WorkloadResult) -> CheckOutcome:
    requests = run.observations
    aborted = requests.loc[requests["error_kind"] == "disconnected"]
    if aborted.empty:
        num_plans = int((requests["intent"] == "abort").sum())
        return _failed(
            f"inconclusive: no request was disconnected mid-stream ({num_plans} abort plan(s) "
            "sent); give the run more requests (--kvcanary-requests)",
            run,
        )
    # Only answers the target really served count: an over-limit probe or a placeholder
    # prompt quoting an aborted request's freed pages is the pool bug (checks 1, 3, 5),
    # not a disconnect leaking into the next owner of its pages.
    dishonest = {
        f.request_id
        for f in run.findings
        if f.kind
        in (
            FindingKind.UNSAFE_ACCEPT,
            FindingKind.PROMPT_TOKENS_MISMATCH,
            FindingKind.FAST_PREFILL,
        )
    }
    served = _accepted(requests.loc[requests["expected"] == "accept"])
    served = served.loc[~served["request_id"].isin(dishonest)]
    aborted_ids = set(aborted["request_id"])
    leaks = [
        f
        for f in _findings(run, ABORT_LEAK_KINDS, served["request_id"])
        if f.victim_request_id in aborted_ids
    ]
    if leaks:
        return _failed(
            f"{len(leaks)} later answer(s) contained canaries of {len(aborted)} request(s) "
            "whose client disconnected mid-stream",
            run,
            leaks,
        )
    return _passed(
        f"{len(aborted)} request(s) disconnected mid-stream; none of their canaries appeared "
        f"in {len(served)} later honest answer(s)",
        run,
    )


def pool_holds_context(audit: AuditResult) -> CheckOutcome:
    from kvcanary.harness.target.audit import SideVerdict

    findings = tuple(f for f in audit.findings if f.kind is FindingKind.POOL_SMALLER_THAN_CONTEXT)
    if findings:
        return CheckOutcome(
            "failed",
            f"{len(findings)} side(s) have a KV pool smaller than the advertised context",
            findings,
        )
    unknown = [side for side in audit.sides if side.verdict is SideVerdict.UNKNOWN]
    if not audit.sides or unknown:
        tried = ", ".join(a.url for a in audit.facts.attempts) or "nothing"
        why = "; ".join(side.reason for side in unknown) or "no side reported a pool"
        return CheckOutcome("skipped", f"the KV pool could not be read ({why}; tried {tried})")
    sides = ", ".join(f"{side.side.role} {side.side.pool_tokens} tokens" for side in audit.sides)
    return CheckOutcome(
        "passed", f"every pool holds the {audit.facts.context_tokens}-token context ({sides})"
    )


def no_shared_prefix_cache(run: WorkloadResult) -> CheckOutcome:
    """The cache probe's verdict: leak fails, clean passes, inconclusive skips."""
    shared = _findings(run, (FindingKind.SHARED_PREFIX_CACHE,))
    if shared:
        pairs = sorted({f"{f.victim_tenant} -> {f.tenant}" for f in shared})
        return _failed(
            f"{len(shared)} probe arm(s) were served from another tenant's prefix cache "
            f"(owner -> prober: {', '.join(pairs)})",
            run,
            shared,
        )
    probe = run.probes.get("cache_probe")
    if probe is None:
        return _failed("inconclusive: the run ended before the cache probe reached a verdict", run)
    reasons = "; ".join(str(r) for r in probe.details.get("assessment", {}).get("reasons", ()))
    if probe.verdict == Verdict.CLEAN:
        return _passed(reasons, run)
    return _skipped(f"isolation unverifiable: {reasons}", run)


def _leak_reason(leaks: Sequence[Finding], where: str) -> str:
    victims = sorted({f.victim_tenant or "?" for f in leaks})
    responders = sorted({f.tenant or "?" for f in leaks})
    return (
        f"{len(leaks)} response(s) {where} contained another tenant's canary "
        f"(responses to {', '.join(responders)}; canaries of {', '.join(victims)})"
    )

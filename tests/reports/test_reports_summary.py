"""Summary: the verdict rules, the counts, and metadata that cannot carry a credential."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from run_journals import TENANTS, RunRecorder

from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.reports.frames import load_frames
from kvcanary.reports.summary import Verdict, compute_summary, safe_settings, safe_target


def summarise(run_dir: Path) -> dict[str, Any]:
    return compute_summary(load_frames(run_dir))


def _victim_and_probe(recorder: RunRecorder, *, probe_status: int | None = 400) -> None:
    recorder.phase("fill")
    recorder.victim("alice", "small", 512)
    recorder.phase("probe")
    recorder.probe(
        "bob",
        "above-pool",
        6000,
        status=probe_status,
        error_kind="http_status" if probe_status is not None else "timeout",
    )


def test_any_finding_is_a_leak(record: Callable[[str], Path]) -> None:
    summary = summarise(record("vulnerable"))
    assert summary["verdict"] == Verdict.LEAK
    assert summary["counts"]["findings_total"] == 4


def test_every_finding_kind_is_counted_even_when_zero(record: Callable[[str], Path]) -> None:
    counts = summarise(record("vulnerable"))["counts"]["findings"]
    assert list(counts) == [str(kind) for kind in FindingKind]
    assert counts["cross_tenant_canary"] == 1
    assert counts["shared_prefix_cache"] == 0
    assert summarise(record("clean"))["counts"]["findings"] == dict.fromkeys(counts, 0)


def test_clean_needs_an_answered_probe_and_an_accepted_victim(
    record: Callable[[str], Path],
) -> None:
    summary = summarise(record("clean"))
    assert summary["verdict"] == Verdict.CLEAN
    assert summary["evidence"]["num_above_limit_answered"] == 2
    assert summary["evidence"]["num_victims_accepted"] == 12
    assert summary["counts"]["requests"] == {
        "total": 14,
        "accepted": 12,
        "rejected": 2,
        "disconnected": 0,
        "errored": 0,
        "unanswered": 0,
    }


def test_interrupted_before_the_probe_phase_is_inconclusive(
    record: Callable[[str], Path],
) -> None:
    summary = summarise(record("interrupted"))
    assert summary["verdict"] == Verdict.INCONCLUSIVE
    assert any("before the probe phase" in reason for reason in summary["verdict_reasons"])
    assert summary["finished"]["reason"] == "interrupted"


def test_an_unreachable_target_is_inconclusive(record: Callable[[str], Path]) -> None:
    summary = summarise(record("unreachable"))
    assert summary["verdict"] == Verdict.INCONCLUSIVE
    reasons = " ".join(summary["verdict_reasons"])
    assert "ended with an error" in reasons
    assert "no victim request was accepted" in reasons


def test_interrupted_after_the_probes_is_still_clean(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "run-late-ctrl-c")
    recorder.start(TENANTS)
    _victim_and_probe(recorder)
    recorder.finish("interrupted")
    assert summarise(tmp_path)["verdict"] == Verdict.CLEAN


def test_a_crashed_run_is_judged_on_what_it_recorded(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "run-crashed")
    recorder.start(TENANTS)
    _victim_and_probe(recorder)
    recorder.writer.close()  # no run_finished record: the process died
    summary = summarise(tmp_path)
    assert summary["verdict"] == Verdict.CLEAN
    assert summary["finished"]["reason"] is None


def test_probes_that_were_never_answered_are_inconclusive(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "run-timeouts")
    recorder.start(TENANTS)
    _victim_and_probe(recorder, probe_status=None)
    recorder.finish("completed")
    summary = summarise(tmp_path)
    assert summary["verdict"] == Verdict.INCONCLUSIVE
    assert summary["verdict_reasons"] == ["no above-limit request was answered by the target"]
    assert summary["counts"]["requests"]["errored"] == 1


def test_an_audit_finding_without_requests_is_unsafe(tmp_path: Path) -> None:
    """A pool too small for the context is a protocol defect: unsafe, not (yet) a leak."""
    recorder = RunRecorder(tmp_path, "run-audit")
    recorder.start(TENANTS)
    recorder.finding(
        Finding(
            kind=FindingKind.POOL_SMALLER_THAN_CONTEXT,
            severity=Severity.HIGH,
            detector="audit",
            request_id=None,
            tenant=None,
            summary="the 4096-token KV pool cannot hold the advertised 8192-token context",
        )
    )
    recorder.finish("completed")
    summary = summarise(tmp_path)
    assert summary["verdict"] == Verdict.UNSAFE
    assert summary["counts"]["findings"]["pool_smaller_than_context"] == 1


def test_metadata_is_copied_through_allow_lists(record: Callable[[str], Path]) -> None:
    summary = summarise(record("vulnerable"))
    assert summary["run_id"] == "run-vuln"
    assert summary["seed"] == 7
    assert summary["limits"]["pool_tokens"] == 4096
    assert summary["tenants"][0] == {"name": "alice", "api_key_env": "KVCANARY_TEST_KEY"}
    assert all(set(tenant) <= {"name", "api_key_env"} for tenant in summary["tenants"])
    assert summary["times"]["started"].startswith("2026-")
    assert summary["phases"] == ["fill", "probe"]
    assert summary["finished"]["reason"] == "completed"


def test_secret_looking_settings_and_url_credentials_are_dropped() -> None:
    settings = {
        "concurrency": 4,
        "engine_fix": ["coverage_check"],
        "api_key": "sk-x",
        "api_key_env": "KEY_VAR",
        "auth_header": "Bearer y",
        "extra": {"a": 1},
    }
    assert safe_settings(settings) == {
        "concurrency": 4,
        "engine_fix": ["coverage_check"],
        "api_key_env": "KEY_VAR",
    }
    assert safe_target("https://user:pw@api.example.com:8443/v1?key=sk-x#f") == (
        "https://api.example.com:8443/v1"
    )
    assert safe_target("http://127.0.0.1:8000") == "http://127.0.0.1:8000"


def test_boundary_probes_are_reported_as_behaviour_not_findings(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "run-boundary")
    recorder.start(TENANTS)
    _victim_and_probe(recorder)
    for status, error_kind in ((200, None), (400, "http_status"), (200, "error_in_success")):
        recorder.request(
            "alice",
            phase="probe",
            intent="probe",
            size_label="pool",
            num_prompt_tokens=4096,
            expected="boundary",
            status=status,
            error_kind=error_kind,  # type: ignore[arg-type]
        )
    recorder.request(
        "alice",
        phase="probe",
        intent="probe",
        size_label="pool",
        num_prompt_tokens=4096,
        expected="boundary",
        answered=False,
    )
    recorder.finish("completed")
    summary = summarise(tmp_path)
    assert summary["boundary"] == {
        "num_sent": 4,
        "accepted": 1,
        "rejected": 2,
        "unanswered": 1,
        "num_prompt_tokens": [4096],
    }
    # an accepted boundary probe is no above-limit answer and no finding: still clean
    assert summary["evidence"]["num_above_limit_sent"] == 1
    assert summary["verdict"] == Verdict.CLEAN


def test_timing_says_not_judged_without_a_fit(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "run-no-fit")
    recorder.start(TENANTS)
    _victim_and_probe(recorder)
    recorder.finish("completed")
    timing = summarise(tmp_path)["timing"]
    assert timing["judged"] is False
    assert "no TTFT fit" in timing["reason"]


def test_timing_is_judged_with_a_fit_that_applies(tmp_path: Path) -> None:
    recorder = RunRecorder(tmp_path, "run-fit")
    recorder.start(TENANTS)
    _victim_and_probe(recorder)
    recorder.timing()
    recorder.finish("completed")
    timing = summarise(tmp_path)["timing"]
    assert timing["num_judged"] >= 1
    assert (timing["judged"], timing["reason"]) == (True, None)


def _within_limits(recorder: RunRecorder, *, victim_status: int = 200) -> None:
    """A `--profile below` run: a victim and a probe, both sized within every limit."""
    recorder.phase("fill")
    recorder.victim(
        "alice",
        "0.5*limit",
        2045,
        status=victim_status,
        error_kind=None if victim_status == 200 else "http_status",
    )
    recorder.phase("probe")
    recorder.request(
        "bob",
        phase="probe",
        intent="probe",
        size_label="limit-1",
        num_prompt_tokens=4089,
        expected="accept",
    )


def test_a_run_within_the_limits_is_clean_and_says_over_limit_was_not_tested(
    tmp_path: Path,
) -> None:
    recorder = RunRecorder(tmp_path, "run-below")
    recorder.start(TENANTS)
    _within_limits(recorder)
    recorder.finish("completed")
    summary = summarise(tmp_path)
    assert summary["evidence"]["num_probes_sent"] == 1
    assert summary["evidence"]["num_above_limit_sent"] == 0
    assert summary["verdict"] == Verdict.CLEAN
    [reason] = summary["verdict_reasons"]
    assert "every one within the limits" in reason
    assert "over-limit handling was not tested" in reason
    unsafe_accept = summary["checks"]["unsafe_accept"]
    assert unsafe_accept["status"] == "not run"
    assert "no prompt above a limit was sent" in unsafe_accept["why"]
    assert summary["checks"]["cross_tenant_canary"]["status"] == "passed"


def test_within_the_limits_a_finding_is_still_a_leak_and_no_victim_is_inconclusive(
    tmp_path: Path,
) -> None:
    leaked = tmp_path / "leaked"
    recorder = RunRecorder(leaked, "run-below-leak")
    recorder.start(TENANTS)
    _within_limits(recorder)
    recorder.finding(
        Finding(
            kind=FindingKind.CROSS_TENANT_CANARY,
            severity=Severity.CRITICAL,
            detector="content",
            request_id=None,
            tenant="bob",
            summary="bob's response contained alice's canary",
        )
    )
    recorder.finish("completed")
    assert summarise(leaked)["verdict"] == Verdict.LEAK

    refused = tmp_path / "refused"
    recorder = RunRecorder(refused, "run-below-refused")
    recorder.start(TENANTS)
    _within_limits(recorder, victim_status=400)
    recorder.finish("completed")
    summary = summarise(refused)
    assert summary["verdict"] == Verdict.INCONCLUSIVE
    assert summary["verdict_reasons"] == [
        "no victim request was accepted, so there was nothing to leak"
    ]


def test_without_probes_no_above_limit_request_is_not_within_limits_only(tmp_path: Path) -> None:
    """Only probes sized within the limits make a within-limits run: a run that sent no
    probe at all (it stopped after filling) is still inconclusive."""
    recorder = RunRecorder(tmp_path, "run-fill-only")
    recorder.start(TENANTS)
    recorder.phase("fill")
    recorder.victim("alice", "0.5*limit", 2045)
    recorder.phase("probe")
    recorder.finish("completed")
    summary = summarise(tmp_path)
    assert summary["evidence"]["num_probes_sent"] == 0
    assert summary["verdict"] == Verdict.INCONCLUSIVE
    assert summary["verdict_reasons"] == ["no above-limit request was answered by the target"]


def test_an_over_limit_prompt_accepted_with_a_real_prefill_is_unsafe_not_a_leak(
    tmp_path: Path,
) -> None:
    """Five requests, the only finding an `unsafe_accept` whose usage shows a real prefill:
    a protocol defect. The same answer faster than a prefill would be the incident."""
    recorder = RunRecorder(tmp_path, "run-five")
    recorder.start(TENANTS)
    recorder.phase("fill")
    for tenant, tokens in (("alice", 512), ("bob", 1024), ("alice", 2048), ("bob", 512)):
        recorder.victim(tenant, str(tokens), tokens, prompt_tokens=tokens)
    recorder.phase("probe")
    probe = recorder.probe("mallory", "above-context", 9000, prompt_tokens=9000)
    recorder.finding(
        Finding(
            kind=FindingKind.UNSAFE_ACCEPT,
            severity=Severity.HIGH,
            detector="protocol",
            request_id=probe.plan.request_id,
            tenant="mallory",
            summary="a 9000-token prompt above the context got HTTP 200 (usage.prompt_tokens="
            "9000 shows a real prefill and nothing leaked)",
        )
    )
    recorder.finish("completed")
    summary = summarise(tmp_path)
    assert summary["counts"]["requests"]["total"] == 5
    assert summary["verdict"] == Verdict.UNSAFE
    assert summary["verdict_reasons"][0].startswith("1 finding(s): 1 unsafe_accept")
    assert "no evidence that one tenant's data reached another" in summary["verdict_reasons"][0]


def test_a_probe_that_could_not_decide_makes_the_run_inconclusive(tmp_path: Path) -> None:
    from run_journals import clean_run

    from kvcanary.harness.record.events import ProbeFinished
    from kvcanary.harness.record.journal import encode_event

    run_dir = clean_run(tmp_path / "run")
    assert summarise(run_dir)["verdict"] == Verdict.CLEAN
    details = {"assessment": {"reasons": ["the positive control saw no cache"]}}
    with (run_dir / "journal.jsonl").open("ab") as journal:
        journal.write(encode_event(ProbeFinished("cache_probe", "inconclusive", details, 2.0)))
    summary = summarise(run_dir)
    assert summary["verdict"] == Verdict.INCONCLUSIVE
    assert summary["verdict_reasons"] == [
        "the cache probe could not reach a decision: the positive control saw no cache"
    ]

"""Recorded runs for report tests and benchmarks: journals written with `harness.record.events`.

`RunRecorder` writes a journal the way the runner does (run start, phases, a plan before
each observation, findings after the observation that caused them, run end), so reports are
tested on the same records a real run produces. The scenario functions build the runs the
tests need: a vulnerable run with the incident's four findings, a clean run, an interrupted
one, one whose target went away, and a large synthetic run for the benchmark.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcanary.canaries.shape import TAG, WORDS
from kvcanary.canaries.span import CanarySpan
from kvcanary.harness.record.events import (
    FindingRecorded,
    Limits,
    ObservationRecorded,
    PhaseStarted,
    PlanRecorded,
    RunFinished,
    RunStarted,
    TimingFitted,
)
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.journal import JournalWriter
from kvcanary.harness.record.observation import ErrorKind, Observation, Usage
from kvcanary.harness.record.ttft_model import TtftModel
from kvcanary.tenants.plan import Expected, Intent, RequestPlan

LIMITS = Limits(pool_tokens=4096, context_tokens=8192, page_size=16, source="engine")
PLANTED_FOREIGN_TEXT = "ZEBRA-QUOTIENT-77-PRIVATE-CUSTOMER-NOTE"
"""Stands for another customer's data inside a leaked response; must never reach a report."""
PLANTED_KEY_ENV = "KVCANARY_TEST_KEY"
PLANTED_KEY_VALUE = "sk-planted-4f1d9c2b7a6e5f3d8c1b"
_T0_WALL = 1_790_000_000.0


def canary_for(request_id: str) -> str:
    """A canary-shaped marker for a request (the real shape: tag and six words from its id)."""
    digest = hashlib.sha256(request_id.encode()).digest()
    words = (WORDS[int.from_bytes(digest[2 * i : 2 * i + 2]) % len(WORDS)] for i in range(6))
    return " ".join((TAG, *words))


def redacted_excerpt(text: str, marker: str) -> str:
    """The shape detectors give foreign excerpts: canary spans kept, the rest hashed."""
    start = text.index(marker)
    before, after = text[:start], text[start + len(marker) :]

    def hidden(part: str) -> str:
        return (
            f"[redacted {len(part)} chars sha256:{hashlib.sha256(part.encode()).hexdigest()[:12]}]"
        )

    return f"{hidden(before)} {marker} {hidden(after)}"


@dataclass
class Request:
    plan: RequestPlan
    observation: Observation | None


class RunRecorder:
    """Writes one run's journal with a simulated clock (1 ms per request by default)."""

    def __init__(self, run_dir: Path, run_id: str, *, fsync_interval_s: float = 1.0) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.writer = JournalWriter(run_dir / "journal.jsonl", fsync_interval_s=fsync_interval_s)
        self.t_ns = 1_000_000_000
        self.num_requests = 0

    @property
    def t_wall(self) -> float:
        return _T0_WALL + self.t_ns / 1e9

    def start(self, tenants: list[dict[str, Any]], *, seed: int = 7) -> None:
        self.writer.write(
            RunStarted(
                run_id=self.run_id,
                target="http://127.0.0.1:8000",
                model="kvc-tiny",
                api="chat",
                limits=LIMITS,
                tenants=tuple(tenants),
                seed=seed,
                canary_key_id="ck-5e1f0a",
                settings={"concurrency": 4, "page_size": 16},
                versions={"kvcanary": "0.1.0", "python": "3.11"},
                t_wall=self.t_wall,
            )
        )

    def phase(self, name: str) -> None:
        self.writer.write(PhaseStarted(phase=name, t_wall=self.t_wall))

    def request(
        self,
        tenant: str,
        *,
        phase: str,
        intent: Intent,
        size_label: str,
        num_prompt_tokens: int,
        expected: Expected,
        status: int | None = 200,
        ttft_ms: float | None = None,
        text: str | None = None,
        prompt_tokens: int | None = None,
        error_kind: ErrorKind | None = None,
        error: str | None = None,
        answered: bool = True,
    ) -> Request:
        """Plan a request and, if `answered`, record what came back."""
        self.num_requests += 1
        request_id = f"{self.run_id}-{tenant}-{self.num_requests:06d}"
        canary = canary_for(request_id)
        plan = RequestPlan(
            request_id=request_id,
            tenant=tenant,
            phase=phase,
            intent=intent,
            size_label=size_label,
            num_prompt_tokens=num_prompt_tokens,
            expected=expected,
            api="chat",
            prompt="",
            canaries=(CanarySpan(text=canary, char_offset=0, token_offset=0, index=0),),
            prompt_sha256=hashlib.sha256(request_id.encode()).hexdigest(),
        )
        self.writer.write(PlanRecorded(plan))
        if not answered:
            return Request(plan, None)
        accepted = status is not None and 200 <= status < 300 and error_kind is None
        if text is None:
            text = f"Echo: {canary}" if accepted else ""  # a target echoing its own canary
        if ttft_ms is None and accepted:
            ttft_ms = 4.0 + 0.02 * num_prompt_tokens  # a prefill that really ran
        sent = self.t_ns + 200_000
        first = None if ttft_ms is None else sent + int(ttft_ms * 1e6)
        done = (first or sent) + 30_000_000
        observation = Observation(
            request_id=request_id,
            tenant=tenant,
            status=status,
            t_wall=self.t_wall,
            t_scheduled_ns=self.t_ns,
            t_sent_ns=sent,
            t_first_byte_ns=first,
            t_first_token_ns=first,
            t_done_ns=done,
            text=text,
            text_sha256=hashlib.sha256(text.encode()).hexdigest(),
            num_text_chars=len(text),
            num_chunks=max(1, len(text) // 8) if text else 0,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(text.split()) or None),
            finish_reason="stop" if error_kind is None and status == 200 else None,
            error_kind=error_kind,
            error=error,
        )
        self.writer.write(ObservationRecorded(observation))
        self.t_ns = done + 1_000_000
        return Request(plan, observation)

    def victim(
        self,
        tenant: str,
        size_label: str = "small",
        tokens: int = 512,
        *,
        phase: str = "fill",
        **observed: Any,
    ) -> Request:
        """`request` for a victim prompt of `tokens` tokens, expected to be accepted."""
        return self.request(
            tenant,
            phase=phase,
            intent="victim",
            size_label=size_label,
            num_prompt_tokens=tokens,
            expected="accept",
            **observed,
        )

    def probe(
        self, tenant: str, size_label: str, tokens: int, *, phase: str = "probe", **observed: Any
    ) -> Request:
        """`request` for a probe of `tokens` tokens, expected to be rejected."""
        return self.request(
            tenant,
            phase=phase,
            intent="probe",
            size_label=size_label,
            num_prompt_tokens=tokens,
            expected="reject",
            **observed,
        )

    def timing(self) -> None:
        """The timing detector's final fit of `request`'s default TTFTs (4 ms + 0.02 ms/token)."""
        model = TtftModel(
            intercept_ms=4.0,
            ms_per_token=0.02,
            scale_ms=0.5,
            num_samples=12,
            num_sigmas=4.0,
            fraction=0.5,
            min_prefill_ms=5.0,
        )
        self.writer.write(TimingFitted(model=model.to_dict(), t_wall=self.t_wall, final=True))

    def finding(self, finding: Finding) -> None:
        self.writer.write(FindingRecorded(finding, t_wall=self.t_wall))

    def finish(self, reason: str, message: str | None = None) -> None:
        self.writer.write(
            RunFinished(
                reason=reason, t_wall=self.t_wall, num_requests=self.num_requests, message=message
            )
        )
        self.writer.close()


TENANTS: list[dict[str, Any]] = [
    {"name": "alice", "api_key_env": PLANTED_KEY_ENV, "header_names": [], "weight": 1.0},
    {"name": "bob", "api_key_env": "BOB_API_KEY", "header_names": [], "weight": 1.0},
    {"name": "mallory", "api_key_env": None, "header_names": [], "weight": 1.0},
]
_FILL_SIZES = (("small", 512), ("medium", 1024), ("large", 2048))
_ABOVE_POOL = ("above-pool", 6000)
_ABOVE_CONTEXT = ("above-context", 12000)


def _fill(recorder: RunRecorder) -> list[Request]:
    recorder.phase("fill")
    victims = []
    for label, tokens in _FILL_SIZES * 2:  # two rounds: enough samples for the timing fit
        for tenant in ("alice", "bob"):
            victims.append(recorder.victim(tenant, label, tokens, prompt_tokens=tokens))
    return victims


def vulnerable_run(run_dir: Path) -> Path:
    """The incident: an above-pool probe is answered 200 from alice's stale pages."""
    recorder = RunRecorder(run_dir, "run-vuln")
    recorder.start(TENANTS)
    victims = _fill(recorder)
    recorder.timing()
    victim = victims[-2]  # alice's large prompt: its pages are what the probe will read
    recorder.phase("probe")
    marker = victim.plan.canaries[0].text
    leaked = f"{PLANTED_FOREIGN_TEXT} and then {marker} followed by more of alice's text"
    probe = recorder.probe(
        "mallory",
        _ABOVE_POOL[0],
        _ABOVE_POOL[1],
        status=200,
        ttft_ms=3.0,
        prompt_tokens=1,
        text=leaked,
    )
    recorder.probe(
        "bob",
        _ABOVE_CONTEXT[0],
        _ABOVE_CONTEXT[1],
        status=400,
        error_kind="http_status",
        error="prompt is longer than the model's context length",
    )
    request_id = probe.plan.request_id
    start = leaked.index(marker)
    recorder.finding(
        Finding(
            kind=FindingKind.CROSS_TENANT_CANARY,
            severity=Severity.CRITICAL,
            detector="content",
            request_id=request_id,
            tenant="mallory",
            summary=f"mallory's response contained alice's canary from {victim.plan.request_id}",
            victim_tenant="alice",
            victim_request_id=victim.plan.request_id,
            marker=marker,
            offsets=(start, start + len(marker)),
            excerpt=redacted_excerpt(leaked, marker),
            details={"match": "exact", "num_canaries": 1},
        )
    )
    recorder.finding(
        Finding(
            kind=FindingKind.UNSAFE_ACCEPT,
            severity=Severity.CRITICAL,
            detector="protocol",
            request_id=request_id,
            tenant="mallory",
            summary="a 6000-token prompt above the 4096-token KV pool was answered with HTTP 200",
            details={"status": 200, "limit": "pool", "limit_tokens": 4096},
        )
    )
    recorder.finding(
        Finding(
            kind=FindingKind.PROMPT_TOKENS_MISMATCH,
            severity=Severity.HIGH,
            detector="protocol",
            request_id=request_id,
            tenant="mallory",
            summary="usage.prompt_tokens is 1 for a 6000-token prompt: it was never prefilled",
            details={"reported": 1, "sent": 6000},
        )
    )
    recorder.finding(
        Finding(
            kind=FindingKind.FAST_PREFILL,
            severity=Severity.HIGH,
            detector="timing",
            request_id=request_id,
            tenant="mallory",
            summary="TTFT 3.0 ms where the fit predicts 124 ms for 6000 tokens",
            details={"ttft_ms": 3.0, "predicted_ms": 124.0, "ratio": 0.024},
        )
    )
    recorder.finish("completed")
    return run_dir


def clean_run(run_dir: Path) -> Path:
    """A safe target: every above-limit probe is rejected with 400, no findings."""
    recorder = RunRecorder(run_dir, "run-clean")
    recorder.start(TENANTS)
    _fill(recorder)
    recorder.timing()
    recorder.phase("probe")
    for tenant, (label, tokens) in (("mallory", _ABOVE_POOL), ("bob", _ABOVE_CONTEXT)):
        recorder.probe(
            tenant, label, tokens, status=400, error_kind="http_status", error="prompt too long"
        )
    recorder.finish("completed")
    return run_dir


def interrupted_run(run_dir: Path) -> Path:
    """Ctrl-C during the fill phase: no probe was ever sent."""
    recorder = RunRecorder(run_dir, "run-interrupted")
    recorder.start(TENANTS)
    recorder.phase("fill")
    recorder.victim("alice", prompt_tokens=512)
    recorder.victim("bob", answered=False)
    recorder.finish("interrupted", "interrupted by the user")
    return run_dir


def unreachable_run(run_dir: Path) -> Path:
    """The target went away: every request failed to connect."""
    recorder = RunRecorder(run_dir, "run-unreachable")
    recorder.start(TENANTS)
    steps: tuple[tuple[str, Intent, Expected, tuple[str, int]], ...] = (
        ("fill", "victim", "accept", _FILL_SIZES[0]),
        ("probe", "probe", "reject", _ABOVE_POOL),
    )
    for phase, intent, expected, (label, tokens) in steps:
        recorder.phase(phase)
        recorder.request(
            "alice",
            phase=phase,
            intent=intent,
            size_label=label,
            num_prompt_tokens=tokens,
            expected=expected,
            status=None,
            error_kind="connect",
            error="connection refused",
        )
    recorder.finish("error", "target unreachable: connection refused")
    return run_dir


def synthetic_run(
    run_dir: Path, num_requests: int, *, seed: int = 0, leak_every: int = 1000
) -> Path:
    """A large run for benchmarks: mixed sizes and outcomes, a leak every `leak_every` probes."""
    rng = random.Random(seed)
    recorder = RunRecorder(run_dir, f"run-synthetic-{num_requests}", fsync_interval_s=60.0)
    recorder.start(TENANTS, seed=seed)
    recorder.phase("soak")
    sizes = (*_FILL_SIZES, _ABOVE_POOL, _ABOVE_CONTEXT)
    num_probes = 0
    for _ in range(num_requests):
        tenant = rng.choice(("alice", "bob", "mallory"))
        label, tokens = rng.choice(sizes)
        if tokens <= LIMITS.pool_tokens:
            recorder.victim(
                tenant,
                label,
                tokens,
                phase="soak",
                prompt_tokens=tokens,
                ttft_ms=4.0 + 0.02 * tokens * rng.uniform(0.8, 1.3),
            )
            continue
        num_probes += 1
        leaks = num_probes % leak_every == 0
        probe = recorder.probe(
            tenant,
            label,
            tokens,
            phase="soak",
            status=200 if leaks else 400,
            ttft_ms=3.0 if leaks else None,
            prompt_tokens=1 if leaks else None,
            text="stale page text" if leaks else None,
            error_kind=None if leaks else "http_status",
            error=None if leaks else "prompt too long",
        )
        if leaks:
            recorder.finding(
                Finding(
                    kind=FindingKind.UNSAFE_ACCEPT,
                    severity=Severity.CRITICAL,
                    detector="protocol",
                    request_id=probe.plan.request_id,
                    tenant=tenant,
                    summary=f"a {tokens}-token prompt above the limit was answered with HTTP 200",
                )
            )
    recorder.finish("completed")
    return run_dir

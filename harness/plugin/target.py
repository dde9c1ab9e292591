"""The target a pytest session tests, and the runs made against it.

A target is a remote deployment (`--kvcanary-target URL`) or the bundled reference engine,
started on first use (`--kvcanary-engine-preset PRESET`, in separate processes, as `kvcanary
run` starts it) and stopped when the session ends. Every run starts from one resolved
`RunConfig` (flags over ini over config file over defaults, `harness.run.config`'s merge) with
the `kvcanary_run(...)` overrides merged over it the same way, runs through
`harness.run.session.run_session` into its own directory under the session's output directory,
and is read back into a `WorkloadResult`: findings, the requests table, `summary.json`, the
verdict.

`SuiteEvidence` makes the built-in suite's evidence (see `harness.plugin.checks`) once per session
and hands the same object to every check that reads it; a run that could not complete is
remembered and reported to each of its checks, never retried.

It deliberately knows nothing about pytest: the plugin turns `KvcanaryError`s into failures
and an unconfigured target into skips. Heavy imports (the session, pandas, the engine) happen
inside methods, so importing this module stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvcanary.canaries.errors import ConfigError, KvcanaryError, RunIncomplete
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.outputs import HTML_NAME, SUMMARY_NAME
from kvcanary.harness.record.verdict import Verdict
from kvcanary.harness.run.config import DEFAULT_CONCURRENCY, Layer, RunConfig, coerce_values, merge
from kvcanary.harness.run.options import OPTIONS_BY_NAME, options_for

if TYPE_CHECKING:
    import pandas as pd

    from kvcanary.harness.plugin.checklist import Check
    from kvcanary.harness.plugin.checks import CheckOutcome, Evidence
    from kvcanary.harness.record.events import ProbeFinished
    from kvcanary.harness.target.audit import AuditResult

SUITE_NUM_REQUESTS = 32
"""Requests in the suite's incident run unless --kvcanary-requests/--kvcanary-duration say
otherwise: enough for fill, every probe size up to `context` and a few disconnects."""
SUITE_CACHE_PROBE_REQUESTS = 4
"""The workload before the suite's cache probe: a few ordinary requests below the limits."""
SUITE_MIN_CONCURRENCY = 4
"""Requests in flight, at least, in the suite's below-limits run (check 4's load)."""
BUNDLED_CONCURRENCY = 1
"""Runs against the bundled engine go one request at a time unless told otherwise, as
`kvcanary run` does: on a small CPU machine that keeps TTFT clean for the timing check."""
_SESSION_ONLY = ("target", "engine_preset", "engine_fix", "engine_prefix_cache", "out", "config")
RUN_OVERRIDES = frozenset(option.name for option in options_for("run")) - set(_SESSION_ONLY)
"""Settings a `kvcanary_run(...)` call may override (the target and the output are the
session's)."""
_LABEL_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
_T = TypeVar("_T")


class RunWorkload(Protocol):
    """The `kvcanary_run` fixture: run a workload against the target, with overrides."""

    def __call__(self, **overrides: Any) -> WorkloadResult: ...


@dataclass(frozen=True, eq=False)
class WorkloadResult:
    """One finished run, read back from its journal and reports."""

    label: str
    out_dir: Path
    verdict: Verdict
    """summary.json's verdict (a `str` enum: `result.verdict == "clean"` reads as it says)."""
    reasons: tuple[str, ...]
    summary: dict[str, Any]
    """summary.json as a dict."""
    findings: list[Finding]
    observations: pd.DataFrame
    """One row per request (`reports.frames` requests table): plan, status, TTFT, usage."""
    findings_table: pd.DataFrame
    ended: str
    """How the run ended (`completed`, `duration`, `interrupted`, `error`)."""
    probes: dict[str, ProbeFinished] = dataclasses.field(default_factory=dict)
    """Opt-in probe phases that reached a verdict, by name (`cache_probe`)."""

    def of_kind(self, *kinds: FindingKind | str) -> list[Finding]:
        """The findings of these kinds (all findings when none is given)."""
        wanted = {str(kind) for kind in kinds}
        return [f for f in self.findings if not wanted or str(f.kind) in wanted]

    @property
    def report(self) -> Path:
        return self.out_dir / HTML_NAME


class TargetUnderTest:
    """The session's target, its bundled engine if one was asked for, and every run made."""

    def __init__(
        self,
        config: RunConfig,
        *,
        engine: str | None = None,
        engine_fixes: tuple[str, ...] = (),
        out_root: Path | None = None,
    ) -> None:
        if engine is not None and config.target is not None:
            raise ConfigError("give --kvcanary-target or --kvcanary-engine-preset, not both")
        fixes = tuple(dict.fromkeys((*config.engine_fix, *engine_fixes)))
        if fixes and engine is None:
            raise ConfigError("--kvcanary-engine-fix needs --kvcanary-engine-preset=PRESET")
        if config.engine_prefix_cache and engine is None:
            raise ConfigError("--kvcanary-engine-prefix-cache needs --kvcanary-engine-preset")
        if engine is not None:  # an unknown preset or fix is a usage error, before any test
            from kvcanary.reference_engine.server.launch import make_config

            make_config(engine, fixes)
        # the engine is this object's business, not the runs': each run sees only its URL
        self.config = dataclasses.replace(
            config,
            engine_fix=(),
            engine_preset=OPTIONS_BY_NAME["engine_preset"].default,
            engine_prefix_cache=False,
        )
        self.engine = engine
        self.engine_fixes = fixes
        self.engine_prefix_cache = config.engine_prefix_cache
        self._out_root = out_root or (Path(config.out) if config.out is not None else None)
        self._base_url = config.target
        self._failure: str | None = None
        self._stack = contextlib.ExitStack()
        self._labels: Counter[str] = Counter()
        self.runs: list[WorkloadResult] = []
        self.audits: list[AuditResult] = []
        self.checks: list[tuple[Check, CheckOutcome]] = []
        """The built-in checks decided in this session, in the order they ran."""

    @property
    def configured(self) -> bool:
        return self.config.target is not None or self.engine is not None

    @property
    def bundled(self) -> bool:
        return self.engine is not None

    def describe(self) -> str:
        if self.engine is None:
            return str(self.config.target)
        fixes = f" + {', '.join(self.engine_fixes)}" if self.engine_fixes else ""
        cache = ", prefix cache on" if self.engine_prefix_cache else ""
        where = f" at {self._base_url}" if self._base_url else ""
        return f"the bundled reference engine ({self.engine}{fixes}{cache}){where}"

    @property
    def base_url(self) -> str:
        """The target's URL; the bundled engine is started on first use."""
        if self._base_url is None:
            self.start()
        assert self._base_url is not None
        return self._base_url

    def start(self) -> None:
        """Start the bundled engine (once); a failure is remembered and raised every time."""
        if self._failure is not None:
            raise RunIncomplete(self._failure)
        if self._base_url is not None:
            return
        if self.engine is None:
            raise ConfigError(
                "no kvcanary target: pass --kvcanary-target=URL or --kvcanary-engine-preset"
            )
        from kvcanary.harness.run.wiring import bundled_engine

        overrides = {"prefix_cache": True} if self.engine_prefix_cache else None
        try:
            url = self._stack.enter_context(
                bundled_engine(self.engine, fixes=self.engine_fixes, overrides=overrides)
            )
        except KvcanaryError as exc:
            self._failure = f"the bundled engine ({self.engine}) cannot start: {exc}"
            raise RunIncomplete(self._failure) from None
        except (OSError, RuntimeError, TimeoutError) as exc:
            self._failure = f"the bundled engine ({self.engine}) did not start: {exc}"
            raise RunIncomplete(self._failure) from None
        self._base_url = url

    def close(self) -> None:
        """Stop the bundled engine, if it was started (idempotent)."""
        self._stack.close()

    @property
    def out_root(self) -> Path:
        """Where this session's runs go: --kvcanary-out, else ./kvcanary-runs/<timestamp>."""
        if self._out_root is None:
            from kvcanary.harness.run.out_dir import default_out_dir

            self._out_root = default_out_dir()
        return self._out_root

    # -- runs ------------------------------------------------------------------------------

    def run_config(self, label: str, overrides: dict[str, Any]) -> RunConfig:
        """The settings of one run: the session's, with `overrides`, into its own directory."""
        unknown = sorted(set(overrides) - RUN_OVERRIDES)
        if unknown:
            raise ConfigError(
                f"kvcanary_run() got unknown setting(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(RUN_OVERRIDES))}"
            )
        given = coerce_values(
            {name: value for name, value in overrides.items() if value is not None},
            lambda option, value: f"kvcanary_run({option.name}={value!r})",
        )
        given.update({name: None for name, value in overrides.items() if value is None})
        session = {k: v for k, v in self.config.to_record().items() if v is not None}
        values = merge(Layer("the session", session), Layer("kvcanary_run()", given))
        paced = any(name in given for name in ("concurrency", "rate"))
        session_paced = self.config.concurrency is not None or self.config.rate is not None
        if self.bundled and not paced and not session_paced:
            values["concurrency"] = BUNDLED_CONCURRENCY
        values.update(target=self.base_url, out=str(self._run_dir(label)))
        return RunConfig.from_values(self.config.command, values)

    def run(self, label: str, **overrides: Any) -> WorkloadResult:
        """Run a workload against the target and read it back. Raises `KvcanaryError`."""
        from kvcanary.harness.run.session import run_session

        config = self.run_config(label, overrides)
        out_dir = Path(str(config.out))
        out_dir.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # beside the run directory, which a run wants new or empty
        with out_dir.with_name(f"{out_dir.name}.progress.log").open("w", encoding="utf-8") as log:
            result = _off_the_loop(run_session, config, file=log, live=False)
        workload = read_result(
            result.out_dir, label=label, verdict=result.verdict, ended=result.outcome.reason
        )
        self.runs.append(workload)
        return workload

    def audit(self) -> AuditResult:
        """The pool-versus-context audit of the target (no probe request)."""
        import httpx

        from kvcanary.harness.target.audit import run_audit
        from kvcanary.tenants.tenant import default_tenants

        headers = default_tenants(1, self.config.api_key_env)[0].auth_headers()

        async def audit() -> AuditResult:
            async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
                return await run_audit(client, target=self.base_url, headers=headers)

        result: AuditResult = _off_the_loop(asyncio.run, audit())
        if not result.facts.reachable:
            raise RunIncomplete(f"cannot reach the target at {self.base_url} for the audit")
        self.audits.append(result)
        return result

    def _run_dir(self, label: str) -> Path:
        name = _LABEL_CHARS.sub("-", label).strip("-.") or "run"
        self._labels[name] += 1
        if self._labels[name] > 1:
            name = f"{name}-{self._labels[name]}"
        path = self.out_root / name
        while path.exists() and any(path.iterdir()):  # an --out reused across sessions
            self._labels[name] += 1
            path = self.out_root / f"{name}-{self._labels[name]}"
        return path


def read_result(out_dir: Path, *, label: str, verdict: Verdict, ended: str) -> WorkloadResult:
    """A finished run's findings, tables and summary, from its directory."""
    from kvcanary.harness.record.events import FindingRecorded, ProbeFinished
    from kvcanary.harness.record.journal import read_journal
    from kvcanary.reports.frames import load_frames
    from kvcanary.reports.summary import compute_summary

    findings, probes = [], {}
    for event in read_journal(out_dir):
        if isinstance(event, FindingRecorded):
            findings.append(event.finding)
        elif isinstance(event, ProbeFinished):
            probes[event.probe] = event
    frames = load_frames(out_dir)
    summary_path = out_dir / SUMMARY_NAME
    if summary_path.exists():
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    else:  # its renderer failed; the same document, computed here
        summary = compute_summary(frames)
    return WorkloadResult(
        label=label,
        out_dir=out_dir,
        verdict=verdict,
        reasons=tuple(str(r) for r in summary.get("verdict_reasons", ())),
        summary=summary,
        findings=findings,
        observations=frames.requests,
        findings_table=frames.findings,
        ended=ended,
        probes=probes,
    )


class SuiteEvidence:
    """The built-in suite's runs and audit, each made once per session, on first need."""

    def __init__(self, target: TargetUnderTest) -> None:
        self.target = target
        self._made: dict[Evidence, WorkloadResult | AuditResult | KvcanaryError] = {}

    def get(self, evidence: Evidence) -> WorkloadResult | AuditResult:
        """The evidence, made now if needed; raises the `KvcanaryError` that stopped it."""
        if evidence not in self._made:
            try:
                self._made[evidence] = self._make(evidence)
            except KvcanaryError as exc:
                self._made[evidence] = exc
        made = self._made[evidence]
        if isinstance(made, KvcanaryError):
            raise made
        return made

    def _make(self, evidence: Evidence) -> WorkloadResult | AuditResult:
        if evidence == "audit":
            return self.target.audit()
        if evidence == "cache_probe":  # the workload is incidental: the probe follows it
            return self.target.run(
                "suite-cache-probe",
                cache_probe=True,
                profile="below",
                requests=SUITE_CACHE_PROBE_REQUESTS,
            )
        config, overrides = self.target.config, dict[str, Any]()
        budget_given = config.requests is not None or config.duration is not None
        if evidence == "incident":
            overrides["profile"] = "incident"
            if not budget_given:
                overrides["requests"] = SUITE_NUM_REQUESTS
        else:
            overrides["profile"] = "below"
            if not budget_given:
                overrides["requests"] = SUITE_NUM_REQUESTS // 2
            if config.rate is None:
                default = BUNDLED_CONCURRENCY if self.target.bundled else DEFAULT_CONCURRENCY
                workers = config.concurrency or default
                overrides["concurrency"] = max(SUITE_MIN_CONCURRENCY, workers)
        return self.target.run(f"suite-{evidence}", **overrides)


def session_summary(target: TargetUnderTest, *, max_findings: int = 10) -> list[str]:
    """What the session did to its target, in lines: each run's verdict, findings, report."""
    lines = [f"target: {target.describe()}"]
    for run in target.runs:
        why = "; ".join(run.reasons)
        lines.append(f"{run.label}: {run.verdict.upper()}" + (f" - {why}" if why else ""))
        for finding in sorted(run.findings, key=_severity_rank)[:max_findings]:
            victim = f" <- {finding.victim_tenant}" if finding.victim_tenant else ""
            lines.append(
                f"  {finding.kind} ({finding.severity}) {finding.request_id or '-'} "
                f"[{finding.tenant or '?'}{victim}]: {finding.summary}"
            )
        if len(run.findings) > max_findings:
            lines.append(f"  ... and {len(run.findings) - max_findings} more finding(s)")
        lines.append(f"  report: {run.report}")
    for audit in target.audits:
        lines.append(f"audit: {audit.verdict.upper()}")
        for side in audit.sides:
            lines.append(f"  {side.side.role} {side.side.url}: {side.verdict} ({side.reason})")
    if target.checks:
        lines.append("checks:")
    for check, outcome in sorted(target.checks, key=lambda item: item[0].number):
        lines.append(f"  {check.number} {outcome.status.upper()}: {check.title}: {outcome.reason}")
    return lines


def _severity_rank(finding: Finding) -> int:
    return list(Severity).index(finding.severity)


def _off_the_loop(function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """`function(...)`, in a worker thread when this thread runs an event loop (an async test):
    the session and the audit run their own loops with `asyncio.run`."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return function(*args, **kwargs)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcanary-run") as pool:
        return pool.submit(function, *args, **kwargs).result()

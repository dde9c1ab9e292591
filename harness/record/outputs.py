"""The run output contract: the files a run directory holds, and the shape of `summary.json`.

    RUN/journal.jsonl   the journal (`harness.record.journal`; rotated segments beside it)
    RUN/summary.json    the verdict, counts and metadata (`Summary` below)
    RUN/report.html     one self-contained page
    RUN/report.md       Markdown for a CI step summary
    RUN/junit.xml       JUnit results
    RUN/evidence/       one file per finding
    RUN/NAME.stale      a soak's report set aside: the soak went on after it was written
                        and its final render did not replace it

Every writer and reader names these files through this module, so an output is named once.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, TypedDict

JOURNAL_NAME = "journal.jsonl"
EVIDENCE_DIR = "evidence"


class ReportFormat(StrEnum):
    """A report `kvcanary report --format` can write (`json` writes `evidence/` too)."""

    HTML = "html"
    MD = "md"
    JUNIT = "junit"
    JSON = "json"

    @property
    def file_name(self) -> str:
        return REPORT_FILES[self]


REPORT_FILES: dict[ReportFormat, str] = {
    ReportFormat.JSON: "summary.json",
    ReportFormat.MD: "report.md",
    ReportFormat.JUNIT: "junit.xml",
    ReportFormat.HTML: "report.html",
}
SUMMARY_NAME = REPORT_FILES[ReportFormat.JSON]
HTML_NAME = REPORT_FILES[ReportFormat.HTML]
MARKDOWN_NAME = REPORT_FILES[ReportFormat.MD]
JUNIT_NAME = REPORT_FILES[ReportFormat.JUNIT]
STALE_SUFFIX = ".stale"
"""Appended to a soak's out-of-date report (`report.html.stale`)."""

SUMMARY_SCHEMA = 1
"""`summary.json`'s `schema`: raised when a key changes meaning (keys are only ever added)."""


class Summary(TypedDict):
    """`summary.json`: what `reports.summary.compute_summary` writes and every reader reads.

    Nested parts are plain JSON objects; the keys a reader relies on are named here."""

    schema: int
    run_id: str | None
    verdict: str
    """A `harness.record.verdict.Verdict` value."""
    verdict_reasons: list[str]
    target: str | None
    """The target URL without user-info, query or fragment."""
    model: str | None
    api: str | None
    limits: dict[str, Any] | None
    """`harness.record.events.Limits` as a JSON object."""
    seed: int | None
    canary_key_id: str | None
    canaries: dict[str, Any]
    tenants: list[dict[str, str | None]]
    settings: dict[str, Any]
    versions: dict[str, Any]
    times: dict[str, Any]
    """`started`, `finished` (ISO 8601), `duration_s`."""
    finished: dict[str, Any]
    """`reason`, `message`, `num_requests_reported` of the run's end record."""
    phases: list[str]
    probes: list[dict[str, Any]]
    checks_not_run: dict[str, str]
    timing: dict[str, Any]
    boundary: dict[str, Any]
    target_unhealthy: dict[str, Any] | None
    leaks: dict[str, Any]
    counts: dict[str, Any]
    """`requests` (by outcome), `requests_by_intent`, `findings` (by kind, every kind),
    `findings_total`, `findings_by_severity`."""
    evidence: dict[str, Any]
    spent: dict[str, Any]
    checks: dict[str, dict[str, Any]]
    """Per finding kind: `status`, `num_findings`, `why` (`reports.checks`)."""
    what_to_do: list[dict[str, Any]]
    """Per finding kind found, most severe first: `kind`, `num_findings`, `problem`,
    `remedies` (each an `action` and its `references`, `label` and `url`), `note`; for
    `unknown_canary` also `spliced` (`reports.remedies`)."""

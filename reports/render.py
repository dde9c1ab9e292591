"""`render_run`: every report of a run, re-rendered from its journal.

Order and isolation: the journal is read once into frames and the summary is computed; then
each output is written on its own (`summary.json` and `evidence/` first, HTML last, since
plots are the most fragile), each to a temporary file renamed into place. One output
failing is recorded in `RenderResult.errors` and never costs the others: a plot that cannot
be drawn still leaves `summary.json`, `report.md`, `junit.xml`, and an HTML page that says
which plot is missing.

It knows the output file names of the run output contract (`harness.record.outputs`;
docs/reference/outputs.md); it does not know how runs are made.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.journal import journal_segments, read_journal
from kvcanary.harness.record.outputs import EVIDENCE_DIR, JOURNAL_NAME, ReportFormat, Summary
from kvcanary.harness.record.verdict import Verdict
from kvcanary.reports import plots
from kvcanary.reports.accounting import Accounting
from kvcanary.reports.evidence import named_request_ids, request_records, write_evidence
from kvcanary.reports.findings import FindingView, listed_findings
from kvcanary.reports.frames import RunFrames, load_frames_accounted
from kvcanary.reports.groups import group_findings
from kvcanary.reports.html import render_html
from kvcanary.reports.journal_lines import SlowPathNeeded
from kvcanary.reports.journal_pick import request_lines
from kvcanary.reports.junit import render_junit
from kvcanary.reports.markdown import render_markdown
from kvcanary.reports.summary import compute_summary
from kvcanary.reports.ttft import journaled_ttft

FORMATS = tuple(str(name) for name in ReportFormat)
_RENDER_ORDER = (ReportFormat.JSON, ReportFormat.MD, ReportFormat.JUNIT, ReportFormat.HTML)


@dataclass(frozen=True)
class RenderResult:
    """What `render_run` wrote, the run's summary and verdict, and what failed."""

    verdict: Verdict
    summary: Summary
    paths: dict[str, Path] = field(default_factory=dict)
    """Format (`json`, `md`, `junit`, `html`, `evidence`) -> the file or directory written."""
    errors: dict[str, str] = field(default_factory=dict)
    """Output or plot that failed -> a one-line reason."""
    accounting: Accounting | None = None
    """How plans and observations paired up, where the render's own pass found it."""


def parse_formats(text: str) -> tuple[str, ...]:
    """`html,md` -> ("html", "md"); an unknown name is a `ConfigError`."""
    formats = tuple(name.strip() for name in text.split(",") if name.strip())
    _check_formats(formats)
    return formats


def _check_formats(formats: Collection[str]) -> None:
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ConfigError(
            f"unknown report format {', '.join(unknown) or '(none given)'}; "
            f"choose from {','.join(FORMATS)}"
        )


def render_run(
    run_dir: Path,
    *,
    formats: Collection[str] = FORMATS,
    keep_raw_evidence: bool = False,
    out_dir: Path | None = None,
) -> RenderResult:
    """Render the reports of the run in `run_dir` (into `out_dir`, default `run_dir`).

    `json` writes `summary.json` and `evidence/`. `keep_raw_evidence` puts full response
    text into evidence files (mode 0600) where the journal has it, and says so on stderr.
    """
    run_dir = Path(run_dir)
    _check_formats(formats)
    if keep_raw_evidence and ReportFormat.JSON not in formats:
        raise ConfigError("--keep-raw-evidence writes evidence/, which needs the json format")
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory (expected a kvcanary run directory)")
    if not journal_segments(run_dir):
        raise ConfigError(f"no journal in {run_dir} (expected {JOURNAL_NAME})")
    frames, accounting = load_frames_accounted(run_dir)
    summary = compute_summary(frames)
    out = Path(out_dir) if out_dir is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    result = RenderResult(Verdict(summary["verdict"]), summary, accounting=accounting)
    listed, num_not_listed = listed_findings(frames.findings)
    writers: dict[ReportFormat, Callable[[], bytes]] = {
        ReportFormat.JSON: lambda: (json.dumps(summary, indent=2) + "\n").encode(),
        ReportFormat.MD: lambda: render_markdown(
            summary,
            listed,
            num_not_listed,
            group_findings(frames.findings, listed),
            frames.run.t_wall if frames.run is not None else None,
        ).encode(),
        ReportFormat.JUNIT: lambda: render_junit(summary, listed, num_not_listed),
        ReportFormat.HTML: lambda: _html(frames, summary, listed, num_not_listed, result.errors),
    }
    for name in _RENDER_ORDER:
        if name not in formats:
            continue
        path = out / name.file_name
        try:
            _write_atomic(path, writers[name]())
            result.paths[name] = path
        except Exception as exc:  # one broken output must not cost the others
            result.errors[name] = _reason(exc)
        if name == ReportFormat.JSON:
            _render_evidence(run_dir, out, frames, keep_raw_evidence, result)
    return result


def _render_evidence(
    run_dir: Path, out: Path, frames: RunFrames, keep_raw: bool, result: RenderResult
) -> None:
    try:
        records = {}
        if not frames.findings.empty:  # a second pass, for the few requests findings name
            named = named_request_ids(frames)
            try:
                records = request_records(request_lines(run_dir, named), named)
            except SlowPathNeeded:
                records = request_records(read_journal(run_dir), named)
        written = write_evidence(frames, out, records, keep_raw=keep_raw)
    except Exception as exc:
        result.errors[EVIDENCE_DIR] = _reason(exc)
        return
    result.paths[EVIDENCE_DIR] = out / EVIDENCE_DIR
    if written.num_raw_kept:
        print(
            f"kvcanary: warning: {written.num_raw_kept} evidence file(s) in "
            f"{out / EVIDENCE_DIR} hold raw response text, which may be another customer's "
            "data; they are readable by you only (0600). Handle them as such.",
            file=sys.stderr,
        )
    if keep_raw and written.num_raw_unavailable:
        print(
            f"kvcanary: warning: raw text unavailable for {written.num_raw_unavailable} "
            "finding(s): the journal holds only redacted text (or no observation) for them.",
            file=sys.stderr,
        )


def _html(
    frames: RunFrames,
    summary: Summary,
    listed: list[FindingView],
    num_not_listed: int,
    errors: dict[str, str],
) -> bytes:
    drawn, notes = _draw_plots(frames, errors)
    return render_html(frames, summary, listed, num_not_listed, drawn, notes).encode()


def _draw_plots(
    frames: RunFrames, errors: dict[str, str]
) -> tuple[dict[str, plots.Plot | None], dict[str, str]]:
    """Each plot on its own: a failure becomes a note on the page and an entry in `errors`."""
    drawn: dict[str, plots.Plot | None] = {}
    notes: dict[str, str] = {}

    def ttft() -> plots.Plot:
        model, notes["ttft_method"] = journaled_ttft(frames)
        return plots.ttft_plot(frames, model)

    steps: dict[str, Callable[[], plots.Plot | None]] = {
        "ttft": ttft,
        "outcome": lambda: plots.outcome_plot(frames),
        "findings": lambda: plots.findings_plot(frames),
    }
    for name, draw in steps.items():
        try:
            drawn[name] = draw()
        except Exception as exc:
            drawn[name] = None
            notes[name] = f"this plot could not be drawn: {_reason(exc)}"
            errors[f"html:{name} plot"] = _reason(exc)
    return drawn, notes


def _reason(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `path` via a temporary file in the same directory, so it is never half-written.

    The file keeps the temporary file's mode, 0600, like the journal it was made from.
    """
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise

"""Every output format renders for every verdict and every finding kind (over the enums, so a
kind or verdict added later is covered here without a new test)."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import run_journals

from kvcanary.harness.record.events import FindingRecorded
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.record.journal import encode_event
from kvcanary.harness.record.outputs import EVIDENCE_DIR, JOURNAL_NAME, REPORT_FILES, ReportFormat
from kvcanary.harness.record.verdict import Verdict
from kvcanary.reports.findings import listed_findings
from kvcanary.reports.frames import load_frames
from kvcanary.reports.html import render_html
from kvcanary.reports.junit import render_junit
from kvcanary.reports.markdown import render_markdown
from kvcanary.reports.render import render_run
from kvcanary.reports.summary import compute_summary


@pytest.fixture(scope="module")
def clean_journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_journals.clean_run(tmp_path_factory.mktemp("every") / "clean")


def with_finding(clean: Path, run_dir: Path, kind: FindingKind) -> Path:
    """The clean run, plus one finding of `kind` on its first above-limit probe."""
    shutil.copytree(clean, run_dir)
    journal = run_dir / JOURNAL_NAME
    probe = next(
        record
        for record in map(json.loads, journal.read_text().splitlines())
        if record["type"] == "plan" and record["expected"] == "reject"
    )
    finding = Finding(
        kind=kind,
        severity=kind.severity,
        detector="test",
        request_id=probe["request_id"],
        tenant=probe["tenant"],
        summary=f"a <b>{kind}</b> | finding",  # markup and a pipe: every format escapes them
    )
    with journal.open("ab") as handle:
        handle.write(encode_event(FindingRecorded(finding, t_wall=1_790_000_001.0)))
    return run_dir


@pytest.mark.parametrize("kind", list(FindingKind))
def test_every_format_renders_a_finding_of_every_kind(
    clean_journal: Path, tmp_path: Path, kind: FindingKind
) -> None:
    result = render_run(with_finding(clean_journal, tmp_path / "run", kind))
    assert result.errors == {}
    assert set(result.paths) == {*ReportFormat, EVIDENCE_DIR}
    assert result.verdict is kind.verdict  # alone on a fully judged run: its row of the table
    summary = json.loads(result.paths[ReportFormat.JSON].read_text())
    assert summary["verdict"] == kind.verdict
    assert summary["counts"]["findings"][kind] == 1
    assert summary["checks"][kind]["status"] == "found"
    markdown = result.paths[ReportFormat.MD].read_text()
    assert f"`{kind}`" in markdown
    assert "<b>" not in markdown
    suite = ET.parse(result.paths[ReportFormat.JUNIT]).getroot()
    assert suite.find(f".//testcase[@name='{kind}']/failure") is not None
    html = result.paths[ReportFormat.HTML].read_text()
    assert kind in html
    assert f"<b>{kind}</b>" not in html
    assert len(list((tmp_path / "run" / EVIDENCE_DIR).iterdir())) == 1


@pytest.mark.parametrize("verdict", list(Verdict))
def test_every_format_renders_every_verdict(clean_journal: Path, verdict: Verdict) -> None:
    """Each renderer takes each verdict the summary can hold (no renderer keeps a table of
    verdicts that misses one)."""
    frames = load_frames(clean_journal)
    summary = compute_summary(frames)
    summary["verdict"] = str(verdict)
    listed, num_not_listed = listed_findings(frames.findings)
    markdown = render_markdown(summary, listed, num_not_listed)
    assert verdict.upper() in markdown.splitlines()[0]
    junit = ET.fromstring(render_junit(summary, listed, num_not_listed))
    assert junit.find(".//property[@name='verdict']").get("value") == verdict  # type: ignore[union-attr]
    html = render_html(frames, summary, listed, num_not_listed, {}, {})
    assert verdict.upper() in html
    assert f".verdict.{verdict} {{ background:" in html  # the headline has its colour
    assert json.loads(json.dumps(summary))["verdict"] == verdict


def test_a_run_s_outputs_are_named_by_the_contract(clean_journal: Path) -> None:
    assert sorted(REPORT_FILES.values()) == [
        "junit.xml",
        "report.html",
        "report.md",
        "summary.json",
    ]
    assert {path.name for path in clean_journal.iterdir()} == {JOURNAL_NAME}

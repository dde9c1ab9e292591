"""render_run: every finding in every format, redaction, credentials, failure isolation."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import run_journals
from run_journals import PLANTED_FOREIGN_TEXT, PLANTED_KEY_ENV, PLANTED_KEY_VALUE

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.harness.record.outputs import REPORT_FILES
from kvcanary.reports import findings as findings_module
from kvcanary.reports import plots
from kvcanary.reports import render as render_module
from kvcanary.reports.html import highlight
from kvcanary.reports.render import RenderResult, render_run
from kvcanary.reports.summary import Verdict


def _outputs(result: RenderResult) -> dict[str, str]:
    """Every file the render wrote (evidence included), by path, as text."""
    files = [path for name, path in result.paths.items() if name != "evidence"]
    files += sorted(result.paths["evidence"].iterdir()) if "evidence" in result.paths else []
    return {str(path): path.read_text(encoding="utf-8") for path in files}


def test_all_outputs_of_the_contract_are_written(rendered: dict[str, RenderResult]) -> None:
    result = rendered["vulnerable"]
    assert result.errors == {}
    assert result.verdict == Verdict.LEAK
    for name, file_name in REPORT_FILES.items():
        assert result.paths[name].name == file_name
        assert result.paths[name].stat().st_size > 0
    assert json.loads(result.paths["json"].read_text())["verdict"] == "leak"
    assert len(list(result.paths["evidence"].iterdir())) == 4


def test_every_finding_appears_in_every_format(rendered: dict[str, RenderResult]) -> None:
    result = rendered["vulnerable"]
    html = result.paths["html"].read_text()
    markdown = result.paths["md"].read_text()
    junit = result.paths["junit"].read_text()
    evidence = [json.loads(p.read_text()) for p in sorted(result.paths["evidence"].iterdir())]
    journal = (result.paths["json"].parent / "journal.jsonl").read_text().splitlines()
    recorded = [json.loads(line) for line in journal if '"type":"finding"' in line]
    assert len(recorded) == len(evidence) == 4
    for finding in recorded:
        summary = finding["summary"]
        assert summary.replace("'", "&#39;") in html
        assert summary in markdown.replace("&#124;", "|")
        assert summary.replace("'", "&apos;") in junit or summary in junit
        (document,) = [e for e in evidence if e["finding"]["summary"] == summary]
        assert f"#{document['finding']['number']} {finding['kind']}" in junit
    for document in evidence:
        assert document["request"]["request_id"] == document["finding"]["request_id"]
    leak = next(e for e in evidence if e["finding"]["kind"] == "cross_tenant_canary")
    victim = leak["victim_request"]
    assert victim["plan"]["tenant"] == "alice"
    assert victim["plan"]["canaries"][0]["text"] == leak["finding"]["marker"]
    assert victim["observation"]["status"] == 200
    assert "text" not in victim["observation"]
    probe = leak["request"]
    assert probe["plan"]["num_prompt_tokens"] == 6000
    assert probe["observation"]["usage"]["prompt_tokens"] == 1
    assert probe["observation"]["text_sha256"]
    assert probe["derived"]["outcome"] == "accepted"
    assert probe["derived"]["ttft_ms"] == pytest.approx(3.0)


def test_foreign_text_never_reaches_a_report(rendered: dict[str, RenderResult]) -> None:
    result = rendered["vulnerable"]
    journal = (result.paths["json"].parent / "journal.jsonl").read_text()
    assert PLANTED_FOREIGN_TEXT in journal  # the leaked response really holds it
    for path, text in _outputs(result).items():
        assert PLANTED_FOREIGN_TEXT not in text, path


def test_keep_raw_evidence_keeps_text_privately_and_says_so(
    record: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = record("vulnerable")
    result = render_run(run_dir, keep_raw_evidence=True)
    assert "raw response text" in capsys.readouterr().err
    evidence = sorted(result.paths["evidence"].iterdir())
    raw = [json.loads(p.read_text())["raw_response"] for p in evidence]
    assert all(section["kept"] for section in raw)
    assert all(PLANTED_FOREIGN_TEXT in section["text"] for section in raw)
    for path in evidence:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for name in ("html", "md", "junit", "json"):  # raw text goes to evidence/ only
        assert PLANTED_FOREIGN_TEXT not in result.paths[name].read_text()
    again = render_run(run_dir)  # re-rendering without the flag removes the raw text
    assert all(PLANTED_FOREIGN_TEXT not in p.read_text() for p in again.paths["evidence"].iterdir())


def test_keep_raw_evidence_without_raw_text_in_the_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recorder = run_journals.RunRecorder(tmp_path, "run-redacted")
    recorder.start(run_journals.TENANTS)
    request = recorder.probe("bob", "above-pool", 6000)
    recorder.finding(
        Finding(
            kind=FindingKind.UNSAFE_ACCEPT,
            severity=Severity.CRITICAL,
            detector="protocol",
            request_id=request.plan.request_id,
            tenant="bob",
            summary="accepted above the pool",
        )
    )
    recorder.finish("completed")
    journal = tmp_path / "journal.jsonl"
    journal.write_text(journal.read_text().replace('"text_redacted":false', '"text_redacted":true'))
    result = render_run(tmp_path, keep_raw_evidence=True)
    assert "raw text unavailable for 1 finding" in capsys.readouterr().err
    (path,) = result.paths["evidence"].iterdir()
    section = json.loads(path.read_text())["raw_response"]
    assert section["kept"] is False
    assert "only the redacted text" in section["note"]


def test_a_credential_in_the_environment_never_reaches_a_report(
    record: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PLANTED_KEY_ENV, PLANTED_KEY_VALUE)
    result = render_run(record("vulnerable"), keep_raw_evidence=True)
    outputs = _outputs(result)
    assert PLANTED_KEY_ENV in outputs[str(result.paths["html"])]  # named, as a reference
    for path, text in outputs.items():
        assert PLANTED_KEY_VALUE not in text, path


def test_the_html_highlights_canaries_in_the_escaped_excerpt() -> None:
    own, other = run_journals.canary_for("a"), run_journals.canary_for("b")
    marked = highlight(f"<b>x</b> {own.upper()} & {other}", [own, None])
    assert str(marked) == (
        f'&lt;b&gt;x&lt;/b&gt; <mark>{own.upper()}</mark> &amp; <mark class="other">{other}</mark>'
    )


def test_the_html_is_self_contained_and_escapes_what_targets_send(
    rendered: dict[str, RenderResult],
) -> None:
    html = rendered["vulnerable"].paths["html"].read_text()
    assert html.index("LEAK") < html.index("Findings")
    assert "<mark>ydk " in html
    assert 'src="http' not in html
    assert 'href="http' not in html
    assert "<script" not in html
    assert html.count('src="data:image/png;base64,') == 3


def test_markup_in_a_finding_is_escaped_everywhere(tmp_path: Path) -> None:
    recorder = run_journals.RunRecorder(tmp_path, "run-markup")
    recorder.start(run_journals.TENANTS)
    recorder.finding(
        Finding(
            kind=FindingKind.UNKNOWN_CANARY,
            severity=Severity.MEDIUM,
            detector="content",
            request_id=None,
            tenant="bob",
            summary="marker <script>alert(1)</script> | seen",
            excerpt="<img src=x onerror=alert(1)>",
        )
    )
    recorder.finish("completed")
    result = render_run(tmp_path)
    for name in ("html", "md"):
        text = result.paths[name].read_text()
        assert "<script>alert" not in text, name
        assert "<img src=x" not in text, name
    # a bare | would split the Markdown table's cells
    assert "&lt;/script&gt; &#124; seen" in result.paths["md"].read_text()


def test_a_failing_plot_costs_only_that_plot(
    record: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> str:
        raise RuntimeError("no fonts today")

    monkeypatch.setattr(plots, "ttft_plot", broken)
    result = render_run(record("vulnerable"))
    assert result.errors == {"html:ttft plot": "RuntimeError: no fonts today"}
    assert set(result.paths) == {"json", "evidence", "md", "junit", "html"}
    assert "this plot could not be drawn: RuntimeError: no fonts today" in (
        result.paths["html"].read_text()
    )


def test_a_failing_format_costs_only_that_format(
    record: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> str:
        raise ValueError("bad table")

    monkeypatch.setattr(render_module, "render_markdown", broken)
    run_dir = record("vulnerable")
    result = render_run(run_dir)
    assert result.errors == {"md": "ValueError: bad table"}
    assert not (run_dir / "report.md").exists()
    assert {"json", "junit", "html", "evidence"} <= set(result.paths)
    assert not list(run_dir.glob(".*.tmp"))


def test_formats_and_out_dir_choose_what_is_written(
    record: Callable[[str], Path], tmp_path: Path
) -> None:
    run_dir = record("clean")
    out = tmp_path / "elsewhere"
    result = render_run(run_dir, formats=("md",), out_dir=out)
    assert set(result.paths) == {"md"}
    assert result.paths["md"] == out / "report.md"
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]
    assert not (run_dir / "report.md").exists()
    assert result.verdict == Verdict.CLEAN


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"formats": ("html", "pdf")}, "unknown report format pdf"),
        ({"formats": ("md",), "keep_raw_evidence": True}, "needs the json format"),
    ],
)
def test_bad_arguments_are_config_errors(
    record: Callable[[str], Path], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        render_run(record("clean"), **kwargs)


def test_a_directory_without_a_journal_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no journal"):
        render_run(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        render_run(tmp_path / "missing")


def test_long_runs_list_some_findings_and_count_the_rest(
    record: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(findings_module, "MAX_LISTED_FINDINGS", 3)
    result = render_run(record("vulnerable"))
    page = result.paths["html"].read_text()
    assert "3 of 4 finding(s) shown" in page
    assert "1 more finding(s) of this group are not shown here" in page
    assert "1 more finding(s) not listed here" in result.paths["md"].read_text()
    junit = result.paths["junit"].read_text()
    assert junit.count('classname="kvcanary.findings.') == 3
    assert 'name="findings not listed individually"' in junit
    assert len(list(result.paths["evidence"].iterdir())) == 4  # evidence keeps every finding

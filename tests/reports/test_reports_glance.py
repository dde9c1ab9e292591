"""What a person reads first: check states everywhere, the leak matrix, grouped findings,
the Run table, and the verdict block the commands print."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import run_journals

from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.reports import groups as groups_module
from kvcanary.reports.render import RenderResult, render_run
from kvcanary.reports.verdict_block import verdict_block

_NOT_RAN = ("not run", "not judged")


def _check_rows(markdown: str) -> dict[str, str]:
    """The Markdown Checks table: kind -> its whole row."""
    section = markdown.split("### Checks", 1)[1].split("###", 1)[0]
    rows = {}
    for line in section.splitlines():
        found = re.match(r"\| \S+ `([a-z_]+)` \|", line)
        if found:
            rows[found.group(1)] = line
    return rows


def _without_timing_fit(run_dir: Path) -> Path:
    journal = run_dir / "journal.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(line for line in lines if b'"timing_fitted"' not in line))
    return run_dir


def test_markdown_never_shows_a_check_that_did_not_run_as_passed(
    rendered: dict[str, RenderResult], tmp_path: Path
) -> None:
    results = {
        **rendered,
        "no fit": render_run(_without_timing_fit(run_journals.clean_run(tmp_path / "c"))),
    }
    num_not_ran = 0
    for name, result in results.items():
        rows = _check_rows(result.paths["md"].read_text())
        assert set(rows) == {str(kind) for kind in FindingKind}, name
        for kind, check in result.summary["checks"].items():
            if check["status"] in _NOT_RAN:
                num_not_ran += 1
                assert "✅" not in rows[kind], (name, rows[kind])
                assert f"{check['status']}: {check['why']}" in rows[kind].replace("&#x27;", "'")
            elif check["status"] == "passed":
                assert "✅" in rows[kind], (name, rows[kind])
    assert num_not_ran >= 9  # two a run never performs, in every scenario, and the timing check


def test_timing_without_a_fit_is_not_judged_everywhere(tmp_path: Path) -> None:
    result = render_run(_without_timing_fit(run_journals.clean_run(tmp_path / "clean")))
    assert result.verdict == "clean"
    check = json.loads(result.paths["json"].read_text())["checks"]["fast_prefill"]
    assert check["status"] == "not judged"
    assert "no timing model" in check["why"] or "no TTFT fit" in check["why"]
    suite = ET.parse(result.paths["junit"]).getroot().find("testsuite")
    assert suite is not None
    skipped = suite.find("testcase[@name='fast_prefill']/skipped")
    assert skipped is not None
    assert skipped.get("message", "").startswith(f"not judged: {check['why']}")
    html = result.paths["html"].read_text()
    assert f"not judged: {check['why']}" in html


def test_a_clean_runs_checks_in_summary_json(rendered: dict[str, RenderResult]) -> None:
    checks = json.loads(rendered["clean"].paths["json"].read_text())["checks"]
    assert {kind: check["status"] for kind, check in checks.items()} == {
        "cross_tenant_canary": "passed",
        "cross_request_canary": "passed",
        "unknown_canary": "passed",
        "unsafe_accept": "passed",
        "fast_prefill": "passed",
        "prompt_tokens_mismatch": "passed",
        "shared_prefix_cache": "not run",
        "pool_smaller_than_context": "not run",
        "error_in_success": "passed",
        "cache_salt_not_bound": "not run",
    }


def test_the_leak_matrix_says_who_read_whose_canary_and_when(
    rendered: dict[str, RenderResult],
) -> None:
    leaks = rendered["vulnerable"].summary["leaks"]
    assert leaks["readers"] == leaks["owners"] == ["alice", "bob", "mallory"]
    assert leaks["counts"] == [[0, 0, 0], [0, 0, 0], [1, 0, 0]]  # mallory read alice's
    assert leaks["num_leaks"] == 1
    assert leaks["first"].startswith("2026-")
    assert leaks["first_after_s"] > 0
    html = rendered["vulnerable"].paths["html"].read_text()
    assert html.index('id="leak-matrix"') < html.index('id="plots"') < html.index('id="findings"')
    markdown = rendered["vulnerable"].paths["md"].read_text()
    assert "| mallory | 1 | · | · |" in markdown
    assert rendered["clean"].summary["leaks"]["num_leaks"] == 0


def test_findings_are_grouped_with_counts_times_and_folded_examples(tmp_path: Path) -> None:
    recorder = run_journals.RunRecorder(tmp_path, "run-many")
    recorder.start(run_journals.TENANTS)
    num = groups_module.MAX_EXAMPLES_PER_GROUP + 5
    for index in range(num):
        recorder.t_ns += 1_000_000_000  # a second apart
        recorder.finding(
            Finding(
                kind=FindingKind.CROSS_TENANT_CANARY,
                severity=Severity.CRITICAL,
                detector="content",
                request_id=f"r{index}",
                tenant="mallory",
                victim_tenant="alice",
                summary=f"leak number {index}",
            )
        )
    recorder.finding(
        Finding(
            kind=FindingKind.CROSS_TENANT_CANARY,
            severity=Severity.CRITICAL,
            detector="content",
            request_id="other",
            tenant="alice",
            victim_tenant="bob",
            summary="the other direction",
        )
    )
    recorder.finish("completed")
    html = render_run(tmp_path).paths["html"].read_text()
    assert html.count('class="group ') == 2
    assert "alice → mallory" in html
    assert "bob → alice" in html
    assert f"{num} finding(s) · first" in html
    first_group = html.split('id="group-1"', 1)[1].split('id="group-2"', 1)[0]
    assert first_group.index("leak number 0") < first_group.index('<details class="more">')
    assert (
        f"{groups_module.MAX_EXAMPLES_PER_GROUP - 1} more example(s) of this group" in first_group
    )
    assert "5 more finding(s) of this group are not shown here" in first_group
    assert f"{groups_module.MAX_EXAMPLES_PER_GROUP + 1} of {num + 1} finding(s) shown" in html


def test_the_run_table_lists_no_unset_or_repeated_setting(tmp_path: Path) -> None:
    recorder = run_journals.RunRecorder(tmp_path, "run-settings")
    recorder.start(run_journals.TENANTS)
    recorder.finish("completed")
    run_started = (tmp_path / "journal.jsonl").read_text().splitlines()[0]
    record = json.loads(run_started)
    record["settings"] = {"seed": None, "target": None, "model": None, "concurrency": 4, "tags": []}
    lines = (tmp_path / "journal.jsonl").read_text().splitlines()
    (tmp_path / "journal.jsonl").write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    html = render_run(tmp_path).paths["html"].read_text()
    run_table = html.split('id="run"', 1)[1]
    assert "<dt>concurrency</dt><dd>4</dd>" in run_table
    assert "None" not in run_table
    assert run_table.count("<dt>seed</dt>") == 1


def test_the_verdict_block_lists_outputs_in_a_fixed_order() -> None:
    block = verdict_block(
        "unsafe",
        ["2 finding(s): 2 unsafe_accept"],
        "interrupted",
        {
            "journal": Path("r/journal.jsonl"),
            "json": Path("r/summary.json"),
            "html": Path("r/report.html"),
        },
    )
    assert block.splitlines() == [
        "verdict: UNSAFE - 2 finding(s): 2 unsafe_accept (run interrupted)",
        "  report    r/report.html",
        "  summary   r/summary.json",
        "  journal   r/journal.jsonl",
    ]


def test_planned_disconnects_are_not_errors(tmp_path: Path) -> None:
    from test_reports_journal_scan import _mixed_run

    result = render_run(_mixed_run(tmp_path / "mixed"))
    requests = result.summary["counts"]["requests"]
    assert requests["disconnected"] == 2  # an abort plan's disconnect and a Ctrl-C cancel
    assert requests["errored"] == 1  # the connection that failed
    assert "<th>disconnected (planned)</th>" in result.paths["html"].read_text()


def test_the_ttft_caption_says_which_lines_are_drawn(
    rendered: dict[str, RenderResult], tmp_path: Path
) -> None:
    with_fit = rendered["clean"].paths["html"].read_text()
    assert "The red dash-dot line is the threshold the detector used" in with_fit
    no_fit = render_run(_without_timing_fit(run_journals.clean_run(tmp_path / "c")))
    caption = no_fit.paths["html"].read_text().split('id="plot-ttft"', 1)[1].split("</figure>")[0]
    assert "threshold the detector used" not in caption
    assert "no line is drawn" in caption


def test_every_finding_kind_has_a_meaning_for_the_reports() -> None:
    from kvcanary.harness.record.finding import FindingKind
    from kvcanary.reports.findings import KIND_MEANINGS

    assert {str(kind) for kind in FindingKind} == set(KIND_MEANINGS)
    assert all(KIND_MEANINGS.values())


def test_markdown_groups_findings_by_kind_owner_and_reader(
    rendered: dict[str, RenderResult],
) -> None:
    result = rendered["vulnerable"]
    text = result.paths["md"].read_text()
    _head, _, rest = text.partition("| kind | owner → reader | findings | first | last |")
    assert rest, "no grouped findings table"
    rows = [line for line in rest.split("\n\n", 1)[0].splitlines()[2:] if line.startswith("|")]
    assert sum(int(row.split("|")[3]) for row in rows) == result.summary["counts"]["findings_total"]
    leak_rows = [row for row in rows if "`cross_tenant_canary`" in row]
    assert leak_rows
    assert all(" → " in row.split("|")[2] for row in leak_rows)
    assert len({tuple(row.split("|")[1:3]) for row in rows}) == len(rows)  # one row a group
    # the full listing follows, folded
    assert (
        rest.index("<details>") < rest.index("| # | kind | severity |") < rest.index("</details>")
    )


def test_prompts_at_the_limit_are_reported_never_judged(
    rendered: dict[str, RenderResult],
) -> None:
    from kvcanary.reports.markdown import render_markdown

    summary = {
        **rendered["clean"].summary,
        "boundary": {
            "num_sent": 3,
            "accepted": 1,
            "rejected": 2,
            "unanswered": 0,
            "num_prompt_tokens": [4096],
        },
    }
    text = render_markdown(summary, [], 0)
    assert "At the limit: 3 prompt(s) of exactly 4096 tokens, 1 accepted, 2 rejected" in text
    quiet = render_markdown({**summary, "boundary": {**summary["boundary"], "num_sent": 0}}, [], 0)
    assert "At the limit" not in quiet


def test_only_an_inconclusive_page_says_no_finding_is_not_safety(
    rendered: dict[str, RenderResult],
) -> None:
    warning = "did not gather enough evidence for that to mean the target is safe"
    assert warning in rendered["interrupted"].paths["html"].read_text()
    assert warning not in rendered["clean"].paths["html"].read_text()

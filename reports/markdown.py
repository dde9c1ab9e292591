"""`report.md`: GitHub-flavoured Markdown for a CI step summary.

The verdict line first, then the leak matrix, the findings table, every check with its
state (`reports.checks`: a check that did not run says "not run", never passed), then
counts. Every cell is escaped for a
GFM table and for the HTML a step summary would otherwise interpret: detector summaries can
quote what a target sent, and a report must not let a target inject markup into CI.
"""

from __future__ import annotations

import html
from typing import Any

from kvcanary.harness.record.outputs import EVIDENCE_DIR, SUMMARY_NAME, Summary
from kvcanary.harness.record.verdict import Verdict
from kvcanary.reports.checks import CheckStatus, check_states
from kvcanary.reports.findings import KIND_MEANINGS, FindingView
from kvcanary.reports.groups import FindingGroup
from kvcanary.reports.remedies import markdown_lines

MAX_EXCERPT_CHARS = 160
_CHECK_MARKS: dict[CheckStatus, str] = {
    "found": "❌",
    "passed": "✅",
    "unproven": "➖",
    "not run": "⏭️",
    "not judged": "⏭️",
}
_VERDICT_MARKS: dict[Verdict, str] = {
    Verdict.LEAK: "🔴",
    Verdict.UNSAFE: "🟠",
    Verdict.CLEAN: "🟢",
    Verdict.INCONCLUSIVE: "🟡",
}
assert set(_VERDICT_MARKS) == set(Verdict), "every verdict has its mark"


def cell(value: Any) -> str:
    """One table cell: HTML-escaped, pipes escaped, on one line."""
    if value is None:
        return ""
    text = html.escape(str(value), quote=False).replace("|", "&#124;")
    return " ".join(text.split())


def render_markdown(
    summary: Summary,
    findings: list[FindingView],
    num_not_listed: int,
    groups: list[FindingGroup] | None = None,
    start: float | None = None,
) -> str:
    """The page. `groups` (`reports.groups.group_findings`) puts one row per (kind, owner
    -> reader) first, with its count, first and last time (from `start`, the run's start)
    and its first example; the full findings table then follows folded in `<details>`."""
    lines = _header_lines(summary)
    lines += _leak_lines(summary.get("leaks"))
    lines += markdown_lines(summary)  # what to do about what was found
    if findings:
        lines += _finding_lines(summary, findings, num_not_listed, groups, start)
    lines += _check_lines(summary)
    lines += _request_lines(summary)
    return "\n".join(lines)


def verdict_badge(verdict: str) -> str:
    """`🔴 LEAK`: the verdict as the page's heading shows it."""
    return f"{_VERDICT_MARKS[Verdict(verdict)]} {verdict.upper()}"


def _header_lines(summary: Summary) -> list[str]:
    lines = [
        f"## kvcanary: {verdict_badge(summary['verdict'])}",
        "",
        "; ".join(cell(reason) for reason in summary["verdict_reasons"]),
        "",
        f"Run {_code(summary['run_id'])} against {_code(summary['target'])} "
        f"(model {_code(summary['model'])}), seed {cell(summary['seed'])}, "
        f"finished: {cell(summary['finished']['reason'] or 'no end record')}.",
        "",
    ]
    guarantee = summary.get("canaries", {}).get("guarantee")
    if guarantee:  # what a leaked page can be attributed by (canaries.guarantee)
        lines += [f"Canaries: {cell(guarantee)}.", ""]
    return lines


def _finding_lines(
    summary: Summary,
    findings: list[FindingView],
    num_not_listed: int,
    groups: list[FindingGroup] | None,
    start: float | None,
) -> list[str]:
    lines = [f"### Findings ({summary['counts']['findings_total']})", ""]
    if groups:
        lines += _group_lines(groups, start)
        lines += ["<details><summary>every listed finding</summary>", ""]
    lines += [
        "| # | kind | severity | who | request | summary | excerpt |",
        "|---|---|---|---|---|---|---|",
    ]
    for view in findings:
        lines.append(
            f"| {view.number} | `{view.kind}` | {view.severity} | {cell(view.who)} "
            f"| {_code(view.request_id)} | {cell(view.summary)} | {_excerpt(view.excerpt)} |"
        )
    if num_not_listed:
        lines.append("")
        lines.append(
            f"{num_not_listed} more finding(s) not listed here: see `{EVIDENCE_DIR}/` and "
            f"`{SUMMARY_NAME}`."
        )
    lines.append("")
    if groups:
        lines += ["</details>", ""]
    return lines


def _check_lines(summary: Summary) -> list[str]:
    lines = ["### Checks", ""]
    if summary["verdict"] == Verdict.INCONCLUSIVE:
        lines += ["Not enough evidence: a check without findings proves nothing here (➖).", ""]
    lines += ["| check | findings | meaning |", "|---|---:|---|"]
    for check in check_states(summary):
        mark, num = _CHECK_MARKS[check.status], str(check.num_findings)
        if not check.ran:
            num = check.status
        meaning = KIND_MEANINGS.get(check.kind, "")
        if check.why:
            meaning = f"{check.status}: {check.why} ({meaning})"
        lines.append(f"| {mark} `{check.kind}` | {num} | {cell(meaning)} |")
    return lines


def _request_lines(summary: Summary) -> list[str]:
    requests = summary["counts"]["requests"]
    lines = [
        "",
        "### Requests",
        "",
        "| total | accepted | rejected | disconnected (planned) | errored | unanswered |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {requests['total']} | {requests['accepted']} | {requests['rejected']} "
        f"| {requests.get('disconnected', 0)} | {requests['errored']} | {requests['unanswered']} |",
        "",
    ]
    boundary = summary.get("boundary") or {}
    if boundary.get("num_sent"):
        sizes = ", ".join(str(n) for n in boundary["num_prompt_tokens"])
        lines += [
            f"At the limit: {boundary['num_sent']} prompt(s) of exactly {sizes} tokens, "
            f"{boundary['accepted']} accepted, {boundary['rejected']} rejected, "
            f"{boundary['unanswered']} unanswered (either answer is defensible: reported, "
            "never a finding).",
            "",
        ]
    return lines


def _code(value: str | None) -> str:
    return f"`{cell(value)}`" if value else "—"


def _excerpt(excerpt: str | None) -> str:
    if not excerpt:
        return ""
    short = excerpt if len(excerpt) <= MAX_EXCERPT_CHARS else excerpt[:MAX_EXCERPT_CHARS] + "…"
    return f"<code>{cell(short)}</code>"


def _leak_lines(leaks: dict[str, Any] | None) -> list[str]:
    """The leak matrix (reader rows, owner columns), when canaries crossed at all."""
    if not leaks or not leaks["num_leaks"]:
        return []
    lines = [
        f"### Leak matrix ({leaks['num_leaks']} leak(s), first {cell(leaks['first'])})",
        "",
        "| reader ↓ owner → | " + " | ".join(cell(o) for o in leaks["owners"]) + " |",
        "|---|" + "---:|" * len(leaks["owners"]),
    ]
    for reader, row in zip(leaks["readers"], leaks["counts"], strict=True):
        lines.append(f"| {cell(reader)} | " + " | ".join(str(n or "·") for n in row) + " |")
    return [*lines, ""]


def _group_lines(groups: list[FindingGroup], start: float | None) -> list[str]:
    """One row per group: kind, owner -> reader, count, first and last time, first example."""
    lines = [
        "| kind | owner → reader | findings | first | last | first example |",
        "|---|---|---:|---|---|---|",
    ]
    for group in groups:
        example = ""
        if group.examples:
            first = group.examples[0]
            example = f"{_code(first.request_id)} {cell(first.summary)} {_excerpt(first.excerpt)}"
        lines.append(
            f"| `{group.kind}` | {cell(group.title)} | {group.num_findings} "
            f"| {_when(group.first_t_wall, start)} | {_when(group.last_t_wall, start)} "
            f"| {example.strip()} |"
        )
    return [*lines, ""]


def _when(t_wall: float, start: float | None) -> str:
    from kvcanary.reports.html import clock  # one clock format for every report

    return cell(clock(t_wall, start))

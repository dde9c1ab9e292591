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

from reports.checks import CheckStatus, check_states
from reports.findings import KIND_MEANINGS, FindingView

MAX_EXCERPT_CHARS = 160
_CHECK_MARKS: dict[CheckStatus, str] = {
    "found": "❌",
    "passed": "✅",
    "unproven": "➖",
    "not run": "⏭️",
    "not judged": "⏭️",
}
_VERDICT_BADGES = {"leak": "🔴 LEAK", "clean": "🟢 CLEAN", "inconclusive": "🟡 INCONCLUSIVE"}


def cell(value: Any) -> str:
    """One table cell: HTML-escaped, pipes escaped, on one line."""
    if value is None:
        return ""
    text = html.escape(str(value), quote=False).replace("|", "&#124;")
    return " ".join(text.split())


def render_markdown(
    summary: dict[str, Any], findings: list[FindingView], num_not_listed: int
) -> str:
    counts = summary["counts"]
    lines = [
        f"## kvcanary: {_VERDICT_BADGES[summary['verdict']]}",
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
    lines += _leak_lines(summary.get("leaks"))
    if findings:
        lines += [
            f"### Findings ({counts['findings_total']})",
            "",
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
                f"{num_not_listed} more finding(s) not listed here: see `evidence/` and "
                "`summary.json`."
            )
        lines.append("")
    lines += ["### Checks", ""]
    if summary["verdict"] == "inconclusive":
        lines += ["Not enough evidence: a check without findings proves nothing here (➖).", ""]
    lines += ["| check | findings | meaning |", "|---|---:|---|"]
    for check in check_states(summary):
        mark, num = _CHECK_MARKS[check.status], str(check.num_findings)
        if not check.ran:
            num = check.status
        meaning = KIND_MEANINGS[check.kind]
        if check.why:
            meaning = f"{check.status}: {check.why} ({meaning})"
        lines.append(f"| {mark} `{check.kind}` | {num} | {cell(meaning)} |")
    requests = counts["requests"]
    lines += [
        "",
        "### Requests",
        "",
        "| total | accepted | rejected | disconnected (planned) | errored | unanswered |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {requests['total']} | {requests['accepted']} | {requests['rejected']} "
        f"| {requests.get('disconnected', 0)} | {requests['errored']} | {requests['unanswered']} |",
        "",
    ]
    return "\n".join(lines)


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

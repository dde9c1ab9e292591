"""`report.md`: GitHub-flavoured Markdown for a CI step summary.

The verdict line first, then the findings table, then counts. Every cell is escaped for a
GFM table and for the HTML a step summary would otherwise interpret: detector summaries can
quote what a target sent, and a report must not let a target inject markup into CI.
"""

from __future__ import annotations

import html
from typing import Any

from harness.record.finding import FindingKind
from reports.findings import KIND_MEANINGS, FindingView

MAX_EXCERPT_CHARS = 160
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
    unproven = "➖" if summary["verdict"] == "inconclusive" else "✅"
    for kind in FindingKind:
        num = counts["findings"][str(kind)]
        mark = "❌" if num else unproven
        lines.append(f"| {mark} `{kind}` | {num} | {cell(KIND_MEANINGS[kind])} |")
    requests = counts["requests"]
    lines += [
        "",
        "### Requests",
        "",
        "| total | accepted | rejected | errored | unanswered |",
        "|---:|---:|---:|---:|---:|",
        f"| {requests['total']} | {requests['accepted']} | {requests['rejected']} "
        f"| {requests['errored']} | {requests['unanswered']} |",
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

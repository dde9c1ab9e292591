"""How a check's result reads in pytest's output: what failed, the findings that show it
(who leaked to whom, the request, an excerpt that is already redacted), and where the
report is."""

from __future__ import annotations

import math
from typing import Any, cast

import pandas as pd

from kvcanary.harness.plugin.checklist import Check
from kvcanary.harness.plugin.checks import CheckOutcome
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.outputs import HTML_NAME

MAX_FINDINGS_SHOWN = 5
"""A failure lists this many findings in full and counts the rest (the report has all)."""


def describe(check: Check, outcome: CheckOutcome) -> str:
    """The text a person reads for a failed check: what failed, the findings, the report."""
    lines = [f"kvcanary check {check.number} failed: {check.title}", f"  {outcome.reason}"]
    rows = _rows_by_id(outcome.requests)
    for finding in outcome.findings[:MAX_FINDINGS_SHOWN]:
        lines.extend(describe_finding(finding, rows.get(finding.request_id or "")))
    for request_id in outcome.request_ids:
        row = rows.get(request_id)
        lines.append(f"  - {request_id}: {_request_line(row) if row else 'not in the journal'}")
    if len(outcome.findings) > MAX_FINDINGS_SHOWN:
        lines.append(f"  ... and {len(outcome.findings) - MAX_FINDINGS_SHOWN} more finding(s)")
    if outcome.out_dir is not None:
        lines.append(f"  report: {outcome.out_dir / HTML_NAME}")
    return "\n".join(lines)


def describe_finding(finding: Finding, row: dict[str, Any] | None = None) -> list[str]:
    """A finding in a few indented lines: kind, who leaked to whom, request, summary, excerpt."""
    head = f"  - {finding.kind} ({finding.severity})"
    if finding.request_id:
        head += f" {finding.request_id}"
    if finding.tenant:
        who = finding.tenant
        if finding.victim_tenant or finding.victim_request_id:
            victim = finding.victim_tenant or "?"
            who += f" <- {victim}'s {finding.victim_request_id or 'request'}"
        head += f" [{who}]"
    lines = [head, f"      {finding.summary}"]
    if row is not None:
        lines.append(f"      request: {_request_line(row)}")
    if finding.excerpt:
        lines.append(f"      excerpt: {' '.join(finding.excerpt.split())[:240]}")
    return lines


def _rows_by_id(requests: pd.DataFrame | None) -> dict[str, dict[str, Any]]:
    if requests is None or requests.empty:
        return {}
    records = cast(list[dict[str, Any]], requests.to_dict("records"))
    return {str(r["request_id"]): r for r in records}


def _request_line(row: dict[str, Any]) -> str:
    parts = [
        f"{row.get('num_prompt_tokens')} tokens ({row.get('size_label')}, "
        f"expected {row.get('expected')})"
    ]
    if _known(row.get("status")):
        parts.append(f"HTTP {int(row['status'])}")
    if _known(row.get("prompt_tokens")):
        parts.append(f"usage.prompt_tokens={row['prompt_tokens']}")
    if _known(row.get("ttft_ms")):
        parts.append(f"TTFT {float(row['ttft_ms']):.0f} ms")
    if _known(row.get("error_kind")):
        parts.append(f"error {row['error_kind']}")
    return ", ".join(parts)


def _known(value: Any) -> bool:
    """Not missing: pandas gives None, NA or NaN for a cell the journal had no value for."""
    return (
        value is not None
        and value is not pd.NA
        and not (isinstance(value, float) and math.isnan(value))
    )

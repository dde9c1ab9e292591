"""Findings as every renderer lists them: ordered, numbered, with the vocabulary's meanings.

HTML, Markdown, JUnit and evidence files all show the same findings in the same order
(most severe first, then as reported) under the same numbers, so "finding 3" means one
thing across a run's outputs. Long runs list at most `MAX_LISTED_FINDINGS` in the human
formats and say how many more there are; evidence files cover every finding.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd

from kvcanary.harness.record.finding import FindingKind, Severity

MAX_LISTED_FINDINGS = 1_000

KIND_MEANINGS: dict[str, str] = {str(kind): kind.meaning for kind in FindingKind}
"""Each kind's meaning, from the verdict table (`harness.record.finding.KIND_RULES`)."""
_SEVERITY_RANK = {str(severity): rank for rank, severity in enumerate(Severity)}


@dataclass(frozen=True, slots=True)
class FindingView:
    """One finding as a report shows it (plain values; None where the detector did not say)."""

    number: int
    kind: str
    severity: str
    detector: str
    request_id: str | None
    tenant: str | None
    victim_tenant: str | None
    victim_request_id: str | None
    marker: str | None
    offsets: tuple[int, int] | None
    excerpt: str | None
    summary: str
    details: dict[str, Any]
    t_wall: float

    @property
    def meaning(self) -> str:
        return KIND_MEANINGS.get(self.kind, "")

    @property
    def who(self) -> str:
        """Who leaked to whom, in words."""
        if self.victim_tenant and self.victim_tenant == self.tenant:
            return f"another request's data reached {self.tenant}'s response"
        if self.victim_tenant and self.tenant:
            return f"{self.victim_tenant}'s data reached {self.tenant}"
        if self.tenant:
            return f"seen by {self.tenant}"
        return "the target"

    def record(self) -> dict[str, Any]:
        """The finding's fields, JSON-ready (for evidence files)."""
        return {
            "number": self.number,
            "kind": self.kind,
            "meaning": self.meaning,
            "severity": self.severity,
            "detector": self.detector,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "victim_tenant": self.victim_tenant,
            "victim_request_id": self.victim_request_id,
            "marker": self.marker,
            "offsets": list(self.offsets) if self.offsets is not None else None,
            "excerpt": self.excerpt,
            "summary": self.summary,
            "details": self.details,
            "t_wall": self.t_wall,
        }


def ordered_findings(findings: pd.DataFrame) -> pd.DataFrame:
    """Most severe first, then in the order they were reported."""
    rank = findings["severity"].astype(str).map(_SEVERITY_RANK).fillna(len(_SEVERITY_RANK))
    return findings.assign(_rank=rank).sort_values("_rank", kind="stable").drop(columns="_rank")


def iter_finding_views(findings: pd.DataFrame) -> Iterator[FindingView]:
    """Every finding, numbered from 1 in report order."""
    rows: Iterator[Any] = ordered_findings(findings).itertuples(index=False)
    for number, row in enumerate(rows, start=1):
        start, end = _value(row.offset_start), _value(row.offset_end)
        yield FindingView(
            number=number,
            kind=str(row.kind),
            severity=str(row.severity),
            detector=str(row.detector),
            request_id=_value(row.request_id),
            tenant=_value(row.tenant),
            victim_tenant=_value(row.victim_tenant),
            victim_request_id=_value(row.victim_request_id),
            marker=_value(row.marker),
            offsets=(int(start), int(end)) if start is not None and end is not None else None,
            excerpt=_value(row.excerpt),
            summary=str(row.summary),
            details=json.loads(row.details_json) if _value(row.details_json) else {},
            t_wall=float(row.t_wall),
        )


def listed_findings(findings: pd.DataFrame) -> tuple[list[FindingView], int]:
    """The findings a human format lists, and how many more it leaves out."""
    listed = ordered_findings(findings).head(MAX_LISTED_FINDINGS)
    return list(iter_finding_views(listed)), max(0, len(findings) - MAX_LISTED_FINDINGS)


def _value(value: Any) -> Any:
    """A frame cell as a plain value, None for any flavour of missing."""
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return None
    return value

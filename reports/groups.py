"""Findings grouped for reading: one group per (kind, owner → reader), most severe first.

A run against a leaking target makes dozens to thousands of findings that say the same
thing; a person needs each distinct story once, with how often and when it happened. A
group's count and first and last times cover every finding of the run; its examples are
the listed findings (`reports.findings.listed_findings`) of that group, at most
`MAX_EXAMPLES_PER_GROUP`, and the page says how many more exist (every finding has its file
in `evidence/`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import pandas as pd

from kvcanary.reports.findings import KIND_MEANINGS, FindingView, ordered_findings
from kvcanary.reports.leaks import UNKNOWN_OWNER, owners

MAX_EXAMPLES_PER_GROUP = 25


@dataclass(frozen=True)
class FindingGroup:
    """Findings of one kind from one owner to one reader."""

    kind: str
    severity: str
    owner: str | None
    """Whose canary the responses held (None: a kind that shows no canary)."""
    reader: str | None
    """The tenant that got the responses (None: a run-level finding, such as an audit)."""
    num_findings: int
    first_t_wall: float
    last_t_wall: float
    examples: list[FindingView] = field(default_factory=list)

    @property
    def title(self) -> str:
        reader = self.reader or "the target"
        if self.owner is None:
            return reader
        if self.owner == UNKNOWN_OWNER:
            return f"a canary of unknown origin → {reader}"
        return f"{self.owner} → {reader}"

    @property
    def meaning(self) -> str:
        return KIND_MEANINGS.get(self.kind, "")

    @property
    def num_not_shown(self) -> int:
        return self.num_findings - len(self.examples)


def _key(owner: object, reader: object, kind: object) -> tuple[str, str, str]:
    def text(value: object) -> str:
        return "" if value is None or value is pd.NA or value != value else str(value)

    return str(kind), text(owner), text(reader)


def group_findings(findings: pd.DataFrame, listed: list[FindingView]) -> list[FindingGroup]:
    """Every group of the run's findings, in report order (that of its first finding)."""
    if findings.empty:
        return []
    ordered = ordered_findings(findings)
    keyed = pd.DataFrame(
        {
            "kind": ordered["kind"].astype(str),
            "owner": owners(ordered).fillna("").astype(str),
            "reader": ordered["tenant"].astype(object).fillna("").astype(str),
            "severity": ordered["severity"].astype(str),
            "t_wall": ordered["t_wall"],
        }
    )
    stats = keyed.groupby(["kind", "owner", "reader"], sort=False).agg(
        severity=("severity", "first"),
        num_findings=("t_wall", "size"),
        first_t_wall=("t_wall", "min"),
        last_t_wall=("t_wall", "max"),
    )
    examples: dict[tuple[str, str, str], list[FindingView]] = {}
    listed_owners = owners(_views_frame(listed)) if listed else pd.Series(dtype=object)
    for view, owner in zip(listed, listed_owners, strict=True):
        chosen = examples.setdefault(_key(owner, view.tenant, view.kind), [])
        if len(chosen) < MAX_EXAMPLES_PER_GROUP:
            chosen.append(view)
    groups = []
    for key, row in stats.iterrows():
        kind, owner, reader = (str(part) for part in cast(tuple[object, object, object], key))
        groups.append(
            FindingGroup(
                kind=kind,
                severity=str(row["severity"]),
                owner=owner or None,
                reader=reader or None,
                num_findings=int(row["num_findings"]),
                first_t_wall=float(row["first_t_wall"]),
                last_t_wall=float(row["last_t_wall"]),
                examples=examples.get((kind, owner, reader), []),
            )
        )
    return groups


def _views_frame(views: list[FindingView]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "kind": [view.kind for view in views],
            "tenant": [view.tenant for view in views],
            "victim_tenant": [view.victim_tenant for view in views],
        }
    )

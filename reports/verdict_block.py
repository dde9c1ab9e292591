"""The verdict block that ends `kvcanary run`, `kvcanary soak` and `kvcanary report`.

One function formats it for every command, so a person (or a script grepping a CI log) sees
the same lines whichever command made the reports:

    verdict: LEAK - 38 finding(s): 19 cross_tenant_canary, 16 prompt_tokens_mismatch, ...
      report    RUN/report.html
      markdown  RUN/report.md
      ...
      journal   RUN/journal.jsonl

It imports nothing but the standard library and the output contract's names
(`harness.record.outputs`): the CLI loads it after a run, and `kvcanary --help` must stay
instant.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from kvcanary.harness.record.outputs import EVIDENCE_DIR, ReportFormat

JOURNAL_OUTPUT = "journal"
OUTPUT_LABELS = {
    ReportFormat.HTML: "report",
    ReportFormat.MD: "markdown",
    ReportFormat.JSON: "summary",
    ReportFormat.JUNIT: "junit",
    EVIDENCE_DIR: "evidence",
    JOURNAL_OUTPUT: "journal",
}
"""Output name (as in `RenderResult.paths`) -> its label in the block, in the block's order."""


def verdict_line(verdict: str, reasons: Iterable[object], ended: str | None) -> str:
    """`verdict: LEAK - 12 finding(s): ...` (plus how the run ended when it did not finish)."""
    why = "; ".join(str(reason) for reason in reasons)
    line = f"verdict: {verdict.upper()}"
    if why:
        line += f" - {why}"
    if ended in ("interrupted", "error"):
        line += f" (run {ended})"
    return line


def verdict_block(
    verdict: str,
    reasons: Iterable[object],
    ended: str | None,
    outputs: Mapping[str, Path],
) -> str:
    """The verdict line, then one line per output written (labelled, in a fixed order)."""
    lines = [verdict_line(verdict, reasons, ended)]
    names = [name for name in OUTPUT_LABELS if name in outputs]
    names += sorted(name for name in outputs if name not in OUTPUT_LABELS)
    for name in names:
        lines.append(f"  {OUTPUT_LABELS.get(name, name):<9} {outputs[name]}")
    return "\n".join(lines)

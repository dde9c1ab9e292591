"""`report.html`: one self-contained page (inline CSS, plots as data URIs, no script).

The page opens with the verdict, then each finding (who leaked to whom, which request, the
redacted excerpt with canary markers highlighted, why the detector fired), then plots,
per-tenant and per-size tables, and the run's metadata from `summary.json`. The template is
autoescaped; the only markup built here is `<mark>` around canary spans in excerpts, built
from escaped pieces.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
import pandas as pd
from markupsafe import Markup, escape

from canaries.shape import CANARY_PATTERN
from reports.findings import FindingView
from reports.frames import RunFrames, size_table, tenant_table


def highlight(excerpt: str, markers: list[str | None]) -> Markup:
    """The excerpt HTML-escaped, the finding's markers in `<mark>`, other canary-shaped spans
    in `<mark class="other">` (a redacted excerpt keeps every canary it saw readable)."""
    lowered = excerpt.lower()
    spans: list[tuple[int, int, int]] = []  # (start, priority, end): markers win overlaps
    for marker in filter(None, markers):
        needle = marker.lower()
        start = lowered.find(needle)
        while start >= 0:
            spans.append((start, 0, start + len(needle)))
            start = lowered.find(needle, start + len(needle))
    if len(lowered) == len(excerpt):  # offsets of the folded text are the excerpt's
        spans += [(m.start(), 1, m.end()) for m in CANARY_PATTERN.finditer(lowered)]
    pieces: list[str] = []
    cursor = 0
    for start, priority, end in sorted(spans):
        if start < cursor:  # overlaps a span already marked
            continue
        tag = "<mark>" if priority == 0 else '<mark class="other">'
        pieces.append(f"{escape(excerpt[cursor:start])}{tag}{escape(excerpt[start:end])}</mark>")
        cursor = end
    pieces.append(str(escape(excerpt[cursor:])))
    return Markup("".join(pieces))


def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("reports", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["highlight"] = lambda view: highlight(
        view.excerpt or "", [view.marker, view.details.get("matched_text")]
    )
    environment.filters["pretty_json"] = lambda value: json.dumps(
        value, indent=2, sort_keys=True, default=str
    )
    return environment


_HEADINGS = {
    "size_label": "size",
    "num_requests": "requests",
    "num_accepted": "accepted",
    "num_rejected": "rejected",
    "num_errored": "errored",
    "num_unanswered": "unanswered",
    "num_prompt_tokens_min": "min tokens",
    "num_prompt_tokens_max": "max tokens",
    "pool_ratio_max": "× pool",
    "context_ratio_max": "× context",
    "ttft_ms_median": "median TTFT (ms)",
    "num_findings": "findings",
    "num_findings_as_victim": "findings as victim",
}


def _table(frame: pd.DataFrame) -> dict[str, Any]:
    """A frame as header and rows of display strings (numbers rounded, missing blank)."""
    frame = frame.reset_index()
    rows = [[_display(value) for value in record] for record in frame.itertuples(index=False)]
    return {"columns": [_HEADINGS.get(str(c), str(c)) for c in frame.columns], "rows": rows}


def _display(value: Any) -> str:
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def render_html(
    frames: RunFrames,
    summary: dict[str, Any],
    findings: list[FindingView],
    num_not_listed: int,
    plots: dict[str, str | None],
    plot_notes: dict[str, str],
) -> str:
    """The page. `plots` maps a plot name to a data URI (None: nothing to draw)."""
    template = _environment().get_template("report.html.j2")
    return template.render(
        summary=summary,
        findings=findings,
        num_not_listed=num_not_listed,
        plots=plots,
        plot_notes=plot_notes,
        tenants=_table(tenant_table(frames)),
        sizes=_table(size_table(frames)),
    )

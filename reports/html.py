"""`report.html`: one self-contained page (inline CSS, plots as data URIs, no script).

The page opens with the answer: the verdict and its reasons in one sentence, the leak matrix
(reader tenant x owner tenant, coloured by count) with the time of the first leak, and every
check's state ("not run" and "not judged" said as such). Then the plots; then the findings
grouped by (kind, owner -> reader), each group with its count and first and last time, its
first example open and the rest folded in `<details>` (at most
`reports.groups.MAX_EXAMPLES_PER_GROUP` each: the page stays usable on a run of millions of
requests, and `evidence/` has every finding); then per-tenant and per-size tables and the
run's metadata from `summary.json`. The template is autoescaped; the only markup built here
is `<mark>` around canary spans in excerpts, built from escaped pieces.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import jinja2
import pandas as pd
from markupsafe import Markup, escape

from kvcanary.canaries.shape import CANARY_PATTERN
from kvcanary.harness.record.outputs import Summary
from kvcanary.harness.record.verdict import Verdict
from kvcanary.reports.checks import check_states
from kvcanary.reports.findings import MAX_LISTED_FINDINGS, FindingView
from kvcanary.reports.frames import RunFrames
from kvcanary.reports.groups import MAX_EXAMPLES_PER_GROUP, group_findings
from kvcanary.reports.plots import Plot
from kvcanary.reports.remedies import code_spans, remedy_list, splice_sentence
from kvcanary.reports.tables import size_table, tenant_table


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
        loader=jinja2.PackageLoader("kvcanary.reports", "templates"),
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
    "num_disconnected": "disconnected (planned)",
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


# Shown elsewhere on the page (the verdict header, the run table, the limits line):
# repeating the raw setting below the real value (`seed None` under `seed 274478309`) only
# confuses.
_SHOWN_SETTINGS = frozenset(
    {"target", "model", "api", "seed", "tenants", "page_size", "keep_raw_evidence"}
)


def run_settings(summary: Summary) -> dict[str, Any]:
    """The settings the Run table lists: none shown elsewhere, none left unset."""
    shown = {
        name: value
        for name, value in summary["settings"].items()
        if name not in _SHOWN_SETTINGS and value is not None and value != []
    }
    guarantee = summary.get("canaries", {}).get("guarantee")
    if guarantee:  # what a leaked page can be attributed by (canaries.guarantee)
        shown["canaries"] = guarantee
    return shown


def clock(t_wall: float | None, start: float | None) -> str:
    """`14:03:21 UTC (+2.3 s)`: a time of the run, and how far into the run it was."""
    if t_wall is None:
        return "—"
    text = datetime.fromtimestamp(t_wall, UTC).strftime("%H:%M:%S UTC")
    if start is not None:
        text += f" (+{t_wall - start:,.1f} s)"
    return text


def cell_style(count: int, top: int) -> str:
    """A matrix cell's colours: white for none, then deeper red the more leaks."""
    if count <= 0 or top <= 0:
        return "background:#f4f6f6;color:#99a3a4"
    strength = 0.25 + 0.75 * count / top
    red, green, blue = (round(255 - (255 - c) * strength) for c in (176, 58, 46))
    ink = "#fff" if strength > 0.55 else "#641e16"
    return f"background:rgb({red},{green},{blue});color:{ink}"


def render_html(
    frames: RunFrames,
    summary: Summary,
    findings: list[FindingView],
    num_not_listed: int,
    plots: dict[str, Plot | None],
    plot_notes: dict[str, str],
) -> str:
    """The page. `plots` maps a plot name to what was drawn (None: nothing to draw)."""
    environment = _environment()
    environment.globals.update(clock=clock, cell_style=cell_style, Verdict=Verdict)
    environment.globals.update(
        code_spans=code_spans, splice_sentence=splice_sentence, remedy_list=remedy_list
    )
    template = environment.get_template("report.html.j2")
    groups = group_findings(frames.findings, findings)
    leaks = summary["leaks"]
    return template.render(
        summary=summary,
        sentence=verdict_sentence(summary),
        start=frames.run.t_wall if frames.run is not None else None,
        leaks=leaks,
        top=max((max(row, default=0) for row in leaks["counts"]), default=0),
        checks=check_states(summary),
        groups=groups,
        num_shown=sum(len(group.examples) for group in groups),
        num_not_listed=num_not_listed,
        max_examples=MAX_EXAMPLES_PER_GROUP,
        max_listed=MAX_LISTED_FINDINGS,
        plots=plots,
        plot_notes=plot_notes,
        settings=run_settings(summary),
        tenants=_table(tenant_table(frames)),
        sizes=_table(size_table(frames)),
    )


def verdict_sentence(summary: Summary) -> str:
    """The verdict and its reasons, as the one sentence the page opens with."""
    reasons = "; ".join(str(reason) for reason in summary["verdict_reasons"])
    return f"{summary['verdict'].upper()}: {reasons}." if reasons else summary["verdict"].upper()

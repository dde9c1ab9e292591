"""The report's plots, as self-contained PNG data URIs: TTFT, outcome by size, findings in time.

Plots are drawn with matplotlib's object API (a `Figure` saved through Agg: no pyplot state,
no display, safe in a worker thread) and embedded as base64, so `report.html` needs no
network and no neighbouring files. Large runs are down-sampled for drawing (to
`MAX_PLOTTED_POINTS`, flagged requests always kept) and the title says so; the TTFT model
comes from `reports.ttft`. Shared conventions: prompt size grows left to right, the KV pool
line is dashed and the context line dotted, limits and series are named in a legend below
the axes (never on the data), outcomes have one palette. Each plot returns its caption,
written from what it actually drew. This module draws; it does not decide what is a finding.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.record.ttft_model import TtftModel
from kvcanary.reports.frames import RunFrames
from kvcanary.reports.tables import cross_counts, size_table

MAX_PLOTTED_POINTS = 20_000

# One palette for every plot: a request is drawn in the same colour wherever it appears.
OUTCOME_COLOURS = {
    "accepted": "#2e6da4",
    "accepted above limit": "#c0392b",
    "rejected": "#7f8c9d",
    "disconnected (planned)": "#8e7cc3",
    "errored": "#e08e0b",
    "unanswered": "#d5d8dc",
}
_LIMIT_STYLES = {"pool": "--", "context": ":"}
_TIME_UNITS = (("hours", 3600.0), ("minutes", 60.0), ("seconds", 1.0))
_SEVERITY_COLOURS = {
    "critical": "#c0392b",
    "high": "#e67e22",
    "medium": "#d4ac0d",
    "low": "#7f8c8d",
}


@dataclass(frozen=True, slots=True)
class Plot:
    """A drawn plot: its PNG as a data URI, and a caption that says what is drawn in it."""

    uri: str
    caption: str


def _png(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _figure(width: float = 9.0, height: float = 4.6) -> tuple[Figure, Axes]:
    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return figure, figure.add_subplot()


def _limit_line(axes: Axes, x: float, name: str, label: str) -> None:
    """A vertical limit line; its label goes to the legend, where it never covers data."""
    axes.axvline(x, color="#555", linestyle=_LIMIT_STYLES[name], linewidth=1.2, label=label)


def _limit_lines(axes: Axes, frames: RunFrames) -> None:
    if frames.run is None:
        return
    limits = frames.run.limits
    for tokens, name in ((limits.pool_tokens, "pool"), (limits.context_tokens, "context")):
        if tokens > 0:
            label = "KV pool" if name == "pool" else "context"
            _limit_line(axes, tokens, name, f"{label}: {tokens:,} tokens")


def _legend(figure: Figure, axes: Axes) -> None:
    """Below the plot, where it never hides points."""
    handles, labels = axes.get_legend_handles_labels()
    if handles:
        figure.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=8)


def _finish(figure: Figure, axes: Axes, title: str, *, grid: str = "both") -> str:
    """The conventions every plot shares: title size, grid, legend below, then the PNG."""
    axes.set_title(title, fontsize=11)
    axes.grid(axis=grid, alpha=0.3)  # type: ignore[arg-type]
    _legend(figure, axes)
    return _png(figure)


def _scatter(axes: Axes, rows: pd.DataFrame, **style: object) -> None:
    axes.scatter(rows["num_prompt_tokens"].astype("float64"), rows["ttft_ms"], **style)  # type: ignore[arg-type]


def ttft_plot(frames: RunFrames, model: TtftModel | None) -> Plot:
    """TTFT against prompt tokens, the timing model's line and threshold, findings marked."""
    requests = frames.requests
    columns = ["request_id", "num_prompt_tokens", "ttft_ms", "expected"]
    has_ttft = requests["ttft_ms"].notna().to_numpy(dtype=bool)
    # Rows chosen before columns are copied: a large run's answered rows are never copied.
    positions = np.flatnonzero(has_ttft)
    num_answered = len(positions)
    findings = frames.findings
    flagged_ids = set(findings["request_id"].dropna())
    fast_ids = set(
        findings.loc[findings["kind"] == str(FindingKind.FAST_PREFILL), "request_id"].dropna()
    )
    figure, axes = _figure()
    title = "Time to first token against prompt length"
    if num_answered > MAX_PLOTTED_POINTS:
        chosen = np.random.default_rng(0).choice(positions, MAX_PLOTTED_POINTS, replace=False)
        positions = np.sort(chosen)
        title += f" ({MAX_PLOTTED_POINTS:,} of {num_answered:,} requests drawn)"
    plotted = requests.iloc[positions][columns]
    del positions
    for expected, colour, label in (
        ("accept", OUTCOME_COLOURS["accepted"], "within the limits"),
        ("reject", OUTCOME_COLOURS["accepted above limit"], "above a limit (answered)"),
    ):
        rows = plotted[plotted["expected"] == expected]
        if len(rows):
            _scatter(axes, rows, s=18, alpha=0.6, color=colour, label=f"{label} ({len(rows):,})")
    flagged = has_ttft & requests["request_id"].isin(flagged_ids).to_numpy(dtype=bool)
    is_fast = requests["request_id"].isin(fast_ids).to_numpy(dtype=bool)
    _flagged_points(axes, requests.loc[flagged & is_fast, columns], fast=True)
    _flagged_points(axes, requests.loc[flagged & ~is_fast, columns], fast=False)
    caption = ["Time to first token against prompt length, one point per answered request."]
    if model is None:
        caption.append("No timing model: fast prefills were not judged, so no line is drawn.")
    elif num_answered:
        longest = float(requests.loc[has_ttft, "num_prompt_tokens"].max())
        caption += _model_lines(axes, model, longest * 1.05)
    _limit_lines(axes, frames)
    axes.set_xlabel("prompt tokens (planned)")
    axes.set_ylabel("TTFT (ms)")
    axes.set_ylim(bottom=0)
    axes.set_xlim(left=0)
    return Plot(_finish(figure, axes, title), " ".join(caption))


def _flagged_points(axes: Axes, rows: pd.DataFrame, *, fast: bool) -> None:
    """Requests with findings, over the scatter: a cross for fast_prefill, a ring otherwise."""
    if not len(rows):
        return
    if fast:
        style = {"marker": "X", "s": 90, "color": "#7b241c"}
        label = f"{FindingKind.FAST_PREFILL} finding ({len(rows):,})"
    else:
        style = {"s": 70, "facecolors": "none", "edgecolors": "#7b241c"}
        label = f"other finding ({len(rows):,})"
    _scatter(axes, rows, zorder=3, label=label, **style)


def _model_lines(axes: Axes, model: TtftModel, x_max: float) -> list[str]:
    """Draw the detector's fit and, where its rule applies, its threshold; say what was drawn."""
    xs = np.linspace(0.0, x_max, 100)
    axes.plot(
        xs,
        model.predict(xs),  # type: ignore[arg-type]
        color="#222",
        linewidth=1.5,
        label=f"timing fit: {model.intercept_ms:.1f} ms + "
        f"{model.ms_per_token * 1000:.2f} ms per 1k tokens",
    )
    said = ["The solid line is the timing detector's own fit, as journaled."]
    start = model.min_eligible_tokens
    if start >= x_max:
        said.append(
            f"Its fast_prefill threshold is not drawn: the rule applies from {start:,.0f} "
            "tokens, longer than any prompt here."
        )
        return said
    eligible = np.linspace(start, x_max, 50)
    axes.plot(
        eligible,
        [model.threshold(x) for x in eligible],
        color="#c0392b",
        linestyle="-.",
        linewidth=1.2,
        label="fast_prefill threshold (flagged below)",
    )
    said.append(
        f"The red dash-dot line is the threshold the detector used (from {start:,.0f} tokens, "
        "where its rule applies): a point below it answered without computing its prompt."
    )
    return said


def outcome_plot(frames: RunFrames) -> Plot:
    """Requests per size label, smallest first, by outcome; the pool and context limits marked."""
    requests = frames.requests
    sizes = size_table(frames)
    labels_in_order = [str(label) for label in sizes.index]
    counts = cross_counts(requests["size_label"], requests["outcome"])
    counts = counts.set_axis(counts.index.astype(str)).set_axis(counts.columns.astype(str), axis=1)
    counts = counts.rename(columns={"disconnected": "disconnected (planned)"})
    counts = counts.reindex(index=labels_in_order, columns=list(OUTCOME_COLOURS), fill_value=0)
    above = requests["outcome"].eq("accepted") & requests["expected"].eq("reject")
    unsafe = requests.loc[above, "size_label"].astype(str).value_counts()
    counts["accepted above limit"] = unsafe.reindex(labels_in_order, fill_value=0)
    counts["accepted"] -= counts["accepted above limit"]
    figure, axes = _figure()
    positions = np.arange(len(counts))
    bottom = np.zeros(len(counts))
    for name, colour in OUTCOME_COLOURS.items():
        values = counts[name].to_numpy(dtype="float64")
        if values.any():
            axes.bar(positions, values, bottom=bottom, color=colour, label=name, width=0.7)
        bottom += values
    labels = []
    for label, row in sizes.iterrows():
        ratio = row["pool_ratio_max"]
        ratio_text = f"\n{ratio:.2f}× pool" if pd.notna(ratio) else ""
        labels.append(f"{label}\n{int(row['num_prompt_tokens_max']):,} tok{ratio_text}")
    axes.set_xticks(positions, labels, fontsize=8)
    axes.set_xlim(-0.6, max(len(counts), 4) - 0.4)  # a few bars stay bar-shaped
    for column, name in (("pool_ratio_max", "pool"), ("context_ratio_max", "context")):
        # A prompt that fills the limit exactly leaves no room to generate: it is over it.
        below = int((sizes[column] < 1.0).sum())
        if 0 < below < len(sizes):  # a boundary between two bars
            label = "KV pool limit" if name == "pool" else "context limit"
            _limit_line(axes, below - 0.5, name, label)
    axes.set_xlabel("prompt size (planned), smallest first")
    axes.set_ylabel("requests")
    caption = (
        "What the target did with each prompt size. Right of the KV pool or context line a "
        "safe target rejects; red bars are prompts above a limit that were accepted. "
        "Planned disconnects (abort plans, Ctrl-C) are the harness's own doing, not errors."
    )
    title = "Outcome by prompt size (relative to the KV pool)"
    return Plot(_finish(figure, axes, title, grid="y"), caption)


def findings_plot(frames: RunFrames) -> Plot | None:
    """When each finding was reported, by kind, coloured by severity; None without findings."""
    findings = frames.findings
    if findings.empty:
        return None
    start = frames.run.t_wall if frames.run is not None else float(findings["t_wall"].min())
    end = frames.finished.t_wall if frames.finished is not None else float(findings["t_wall"].max())
    span_s = max(end - start, float(findings["t_wall"].max()) - start, 1e-3)
    unit, seconds = next((u, s) for u, s in _TIME_UNITS if span_s >= 3 * s or s == 1.0)
    elapsed = (findings["t_wall"] - start) / seconds
    kinds = [str(kind) for kind in FindingKind]
    rows = findings["kind"].astype(str).map({kind: i for i, kind in enumerate(kinds)})
    figure, axes = _figure(height=3.8)
    for severity, colour in _SEVERITY_COLOURS.items():
        chosen = findings["severity"] == severity
        if chosen.any():
            axes.scatter(elapsed[chosen], rows[chosen], color=colour, s=30, label=severity)
    axes.set_xlim(0, span_s / seconds * 1.02)
    axes.set_yticks(range(len(kinds)), kinds, fontsize=8)
    axes.set_ylim(-0.5, len(kinds) - 0.5)
    axes.set_xlabel(f"{unit} since the run started")
    caption = "When each finding was reported during the run, by kind, coloured by severity."
    return Plot(_finish(figure, axes, "Findings over time"), caption)

"""Per-tenant and per-size tables of a run's requests and findings (`report.html`, plots).

Counts by outcome come from the requests' category codes (`cross_counts`), so a table of a
million-request run costs one `numpy.bincount`, not a pivot.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from kvcanary.reports.frames import OUTCOMES, RunFrames


def tenant_table(frames: RunFrames) -> pd.DataFrame:
    """Per tenant: requests by outcome, TTFT, and findings as the responder and as the victim."""
    requests = frames.requests
    table = _outcome_counts(requests, "tenant")
    table["ttft_ms_median"] = requests.groupby("tenant", observed=True)["ttft_ms"].median()
    findings = frames.findings
    table["num_findings"] = findings.groupby("tenant", observed=True).size()
    table["num_findings_as_victim"] = findings.groupby("victim_tenant", observed=True).size()
    return _fill_counts(table)


def size_table(frames: RunFrames) -> pd.DataFrame:
    """Per size label, smallest first: prompt size against the limits, outcomes, TTFT, findings."""
    requests = frames.requests
    grouped = requests.groupby("size_label", observed=True)
    table = _outcome_counts(requests, "size_label")
    table["num_prompt_tokens_min"] = grouped["num_prompt_tokens"].min()
    table["num_prompt_tokens_max"] = grouped["num_prompt_tokens"].max()
    table["pool_ratio_max"] = grouped["pool_ratio"].max()
    table["context_ratio_max"] = grouped["context_ratio"].max()
    table["expected"] = grouped["expected"].agg(_expected_label)
    table["ttft_ms_median"] = grouped["ttft_ms"].median()
    named = requests.loc[requests["request_id"].isin(frames.findings["request_id"].dropna())]
    request_size = dict(zip(named["request_id"], named["size_label"], strict=True))
    finding_size = frames.findings["request_id"].map(request_size)
    table["num_findings"] = frames.findings.groupby(finding_size, observed=True).size()
    table = _fill_counts(table)
    return table.sort_values(["num_prompt_tokens_max", "num_prompt_tokens_min"], kind="stable")


def _expected_label(values: pd.Series[Any]) -> str:
    distinct = sorted({str(v) for v in values.dropna().unique()})
    return "/".join(distinct) if distinct else "?"


def cross_counts(rows: pd.Series[Any], columns: pd.Series[Any]) -> pd.DataFrame:
    """`pandas.crosstab(rows, columns)`, counted from the category codes with one
    `numpy.bincount` where both are categorical (crosstab's pivot through a groupby costs a
    copy of both columns and more at a million rows): the same frame, category order, the
    rows and columns that occur, nulls left out."""
    if not isinstance(rows.dtype, pd.CategoricalDtype) or not isinstance(
        columns.dtype, pd.CategoricalDtype
    ):
        return pd.crosstab(rows, columns)
    row_codes = rows.cat.codes.to_numpy()
    column_codes = columns.cat.codes.to_numpy()
    both = (row_codes >= 0) & (column_codes >= 0)
    num_rows, num_columns = len(rows.cat.categories), len(columns.cat.categories)
    pairs = row_codes[both].astype(np.int64) * num_columns + column_codes[both]
    counts = np.bincount(pairs, minlength=num_rows * num_columns).reshape(num_rows, num_columns)
    seen_rows, seen_columns = counts.sum(axis=1) > 0, counts.sum(axis=0) > 0
    index = pd.CategoricalIndex(rows.cat.categories[seen_rows], dtype=rows.dtype, name=rows.name)
    header = pd.CategoricalIndex(
        columns.cat.categories[seen_columns], dtype=columns.dtype, name=columns.name
    )
    return pd.DataFrame(counts[seen_rows][:, seen_columns], index=index, columns=header)


def _outcome_counts(requests: pd.DataFrame, by: str) -> pd.DataFrame:
    counts = cross_counts(requests[by], requests["outcome"]).reindex(columns=OUTCOMES, fill_value=0)
    counts.columns = pd.Index([f"num_{outcome}" for outcome in OUTCOMES])
    counts.insert(0, "num_requests", counts.sum(axis=1))
    counts.index.name = by
    return counts


def _fill_counts(table: pd.DataFrame) -> pd.DataFrame:
    for column in table.columns:
        if column.startswith("num_") and not column.startswith("num_prompt_tokens"):
            table[column] = table[column].fillna(0).astype("int64")
    return table

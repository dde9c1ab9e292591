"""The TTFT model the timing detector fits, refitted from a run's frames for the report's plot.

The line in the report must be the timing detector's line, not a look-alike, so this module
replays requests through `harness.detectors.timing.TimingDetector` (the same fit set, the
same Siegel repeated-medians fit, the same flag threshold) and returns its final model. The
detector keeps a seeded reservoir of at most `max_fit_samples` points anyway, so replaying a
seeded sample of `MAX_REPLAYED` candidates gives the same kind of fit in bounded time on
runs of millions of requests. Parameters are the detector's defaults; the model a finding
was actually flagged with travels in that finding's `details["model"]`.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from harness.detectors.timing import TimingDetector, TtftModel
from harness.observation import Observation, Usage
from tenants.plan import RequestPlan

MAX_REPLAYED = 20_000
_REPLAYED_COLUMNS = (
    "request_id",
    "tenant",
    "phase",
    "intent",
    "size_label",
    "num_prompt_tokens",
    "expected",
    "api",
    "status",
    "t_wall",
    "ttft_ms",
    "prompt_tokens",
    "error_kind",
)
METHOD = "harness.detectors.timing.TimingDetector (default parameters), replayed on this run"


def refit_ttft(requests: pd.DataFrame) -> TtftModel | None:
    """The timing detector's final model over this run's answered requests, or None if it
    has too few samples to fit."""
    served = requests.loc[
        requests["ttft_ms"].notna()
        & requests["expected"].notna()
        & requests["status"].between(200, 299).fillna(False).astype(bool),
        list(_REPLAYED_COLUMNS),
    ]
    if len(served) > MAX_REPLAYED:
        served = served.sample(MAX_REPLAYED, random_state=0).sort_index()
    detector = TimingDetector()
    for row in served.itertuples(index=False):
        plan, observation = _replay(row)
        detector.observe(plan, observation)
    detector.finish()
    return detector.model


def _replay(row: Any) -> tuple[RequestPlan, Observation]:
    """A plan and observation carrying exactly what the detector reads from a frame row."""
    plan = RequestPlan(
        request_id=str(row.request_id),
        tenant=str(row.tenant),
        phase=str(row.phase),
        intent=row.intent,
        size_label=str(row.size_label),
        num_prompt_tokens=int(row.num_prompt_tokens),
        expected=row.expected,
        api=row.api,
        prompt="",
    )
    reported = row.prompt_tokens
    observation = Observation(
        request_id=plan.request_id,
        tenant=plan.tenant,
        status=int(row.status),
        t_wall=float(row.t_wall),
        t_scheduled_ns=0,
        t_sent_ns=0,
        t_first_token_ns=round(float(row.ttft_ms) * 1e6),
        usage=Usage(prompt_tokens=None if reported is pd.NA else int(reported)),
        error_kind=_text_or_none(row.error_kind),
    )
    return plan, observation


def _text_or_none(value: Any) -> Any:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return str(value)

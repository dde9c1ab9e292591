"""The target's own word on what it served from cache, weighed against the miss arm.

Two witnesses can speak for an arm besides its timing: `usage.prompt_tokens_details.
cached_tokens` per timed request, and the engine's prefix-cache hit counter's increase over
each timed request (`harness.cache_probe.counters`). Either is evidence only by how much it
exceeds the same probe's miss arm: a disaggregated vLLM's decode reports the KV it loaded
from prefill as `cached_tokens` on every request, misses included, and a chat template's
common prefix is cached for everyone. So a trial is a *witnessed hit* when its count exceeds
the miss arm's median count by at least half of the shared prefix, and the witness *says
hit* for the arm when most of its reporting trials are. A witness whose miss arm reported
nothing says nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcanary.canaries.records import field_record

REPORTED_HIT_FRACTION = 0.5
"""A witnessed hit exceeds the miss arm's count by at least this share of the shared prefix."""


@dataclass(frozen=True, slots=True)
class GroundTruth:
    """What one of the target's counts says about one arm's trials."""

    num_trials: int
    num_reporting: int
    """Trials whose count is known (the response carried `cached_tokens`, the counters read)."""
    num_reported_hits: int
    threshold_tokens: int
    median_count: float | None
    control_median: float | None = 0.0
    """The miss arm's median count, which every trial's count must exceed by the threshold;
    None when the miss arm reported none (then nothing is a hit)."""

    @property
    def says_hit(self) -> bool | None:
        """Most reporting trials were hits; None when the arm or its control reports nothing."""
        if self.num_reporting == 0 or self.control_median is None:
            return None
        return self.num_reported_hits * 2 > self.num_reporting

    def to_details(self) -> dict[str, Any]:
        return field_record(self, renamed={"median_count": "median"}, says_hit=self.says_hit)


def reported_truth(
    counts: Sequence[float | None],
    shared_tokens: int,
    control: Sequence[float | None] | None = None,
) -> GroundTruth:
    """One witness for one arm: trials whose count exceeds `control`'s median (the miss
    arm's counts; none given: zero) by at least half of `shared_tokens`."""
    threshold = max(1, math.ceil(REPORTED_HIT_FRACTION * shared_tokens))
    reported = [c for c in counts if c is not None]
    level: float | None = 0.0
    if control is not None:
        known = [c for c in control if c is not None]
        level = float(np.median(known)) if known else None
    hits = 0 if level is None else sum(c - level >= threshold for c in reported)
    return GroundTruth(
        num_trials=len(counts),
        num_reporting=len(reported),
        num_reported_hits=hits,
        threshold_tokens=threshold,
        median_count=float(np.median(reported)) if reported else None,
        control_median=level,
    )

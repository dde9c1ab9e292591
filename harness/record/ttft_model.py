"""The timing detector's model of a target: TTFT as a line in prompt tokens, and the rule
that turns it into a `fast_prefill` verdict.

It is part of the run's vocabulary because three sides read the same line: the timing
detector fits it (`harness.detectors.timing`), the journal records the fit the detector
used (`TimingFitted`), and reports and the plugin's checks draw and apply exactly that line.
This module knows the arithmetic of the rule; it does not fit anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TtftModel:
    """A fitted TTFT-vs-prompt-tokens line and the rule that turns it into a verdict."""

    intercept_ms: float
    ms_per_token: float
    scale_ms: float
    """Noise of the fastest responses: (Q25 - Q05) of the residuals / 0.9704, floored."""
    num_samples: int
    """Samples in the fit (at most `max_fit_samples`)."""
    num_sigmas: float
    fraction: float
    min_prefill_ms: float
    method: str = "siegelslopes"

    def predict(self, num_tokens: float) -> float:
        """Expected TTFT in ms for a prompt of `num_tokens` tokens (works on arrays too)."""
        return self.intercept_ms + self.ms_per_token * num_tokens

    def lower_bound(self, num_tokens: float) -> float:
        """Below this a real prefill is implausible (k noise scales under the prediction)."""
        return self.predict(num_tokens) - self.num_sigmas * self.scale_ms

    def threshold(self, num_tokens: float) -> float:
        """TTFTs below this are flagged: less than `fraction` of the prefill work was done."""
        return (
            self.intercept_ms
            + self.fraction * self.ms_per_token * num_tokens
            - self.num_sigmas * self.scale_ms
        )

    def eligible(self, num_tokens: float) -> bool:
        """Whether the predicted prefill of this length stands far enough above the noise."""
        prefill_ms = self.ms_per_token * num_tokens
        return (
            self.fraction * prefill_ms >= 2 * self.num_sigmas * self.scale_ms
            and prefill_ms >= self.min_prefill_ms
        )

    def is_fast(self, num_tokens: float, ttft_ms: float) -> bool:
        return self.eligible(num_tokens) and ttft_ms < self.threshold(num_tokens)

    @property
    def min_eligible_tokens(self) -> float:
        """The shortest prompt the rule applies to (inf if the slope is zero)."""
        if self.ms_per_token <= 0:
            return float("inf")
        by_noise = 2 * self.num_sigmas * self.scale_ms / (self.fraction * self.ms_per_token)
        return max(by_noise, self.min_prefill_ms / self.ms_per_token)

    @property
    def rule(self) -> str:
        return (
            f"flag when ttft < intercept + {self.fraction:g} x ms_per_token x n - "
            f"{self.num_sigmas:g} x scale, for n with {self.fraction:g} x ms_per_token x n >= "
            f"{2 * self.num_sigmas:g} x scale and ms_per_token x n >= {self.min_prefill_ms:g} ms"
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TtftModel:
        """The model `to_dict` wrote (derived entries such as `rule` are ignored)."""
        return cls(
            intercept_ms=float(values["intercept_ms"]),
            ms_per_token=float(values["ms_per_token"]),
            scale_ms=float(values["scale_ms"]),
            num_samples=int(values["num_samples"]),
            num_sigmas=float(values["num_sigmas"]),
            fraction=float(values["fraction"]),
            min_prefill_ms=float(values["min_prefill_ms"]),
            method=str(values.get("method", "siegelslopes")),
        )

    def to_dict(self) -> dict[str, float | int | str]:
        """Plain values for summary.json and reports."""
        return {
            "intercept_ms": self.intercept_ms,
            "ms_per_token": self.ms_per_token,
            "scale_ms": self.scale_ms,
            "num_samples": self.num_samples,
            "num_sigmas": self.num_sigmas,
            "fraction": self.fraction,
            "min_prefill_ms": self.min_prefill_ms,
            "min_eligible_tokens": self.min_eligible_tokens,
            "method": self.method,
            "rule": self.rule,
        }

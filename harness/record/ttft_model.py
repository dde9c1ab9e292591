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
    """A fitted TTFT-vs-prompt-tokens line and the rule that turns it into a verdict.

    With f = `fraction`, k = `num_sigmas`, I = `intercept_ms`, s = the slope's 99 % lower
    confidence bound (`ms_per_token_low`) and scale = the fast side's noise, two bars:

        additive(n)       = I + f s n - k scale   for n with  f s n >= 2 k scale
        proportional(n)   = f (I + s n)           for n with  f (I + s n) >= I  and
                                                  I + slope n - proportional(n) >= k scale

    (and s n >= `min_prefill_ms` for both). An answer is too fast when its TTFT is under the
    higher bar that applies to its length. The additive bar says "less than half the prefill
    was done, beyond k noise scales"; it judges targets with a large fixed latency. The
    proportional bar says "faster than half the whole predicted TTFT"; it keeps judging on a
    loaded machine, where contention widens the spread (and so the noise scale) although a
    delay never makes an answer faster. A real prefill falls under either only if it ran
    more than k noise scales, and more than 1/f times, faster than the fit's fast side.
    """

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
    ms_per_token_low: float | None = None
    """99 % lower confidence bound of the slope (Theil-Sen); None: the slope itself."""

    @property
    def slope_low(self) -> float:
        low = self.ms_per_token if self.ms_per_token_low is None else self.ms_per_token_low
        return max(0.0, min(low, self.ms_per_token))

    def predict(self, num_tokens: float) -> float:
        """Expected TTFT in ms for a prompt of `num_tokens` tokens (works on arrays too)."""
        return self.intercept_ms + self.ms_per_token * num_tokens

    def lower_bound(self, num_tokens: float) -> float:
        """Below this a real prefill is implausible (k noise scales under the prediction)."""
        return self.predict(num_tokens) - self.num_sigmas * self.scale_ms

    def threshold(self, num_tokens: float) -> float:
        """TTFTs below this are flagged (the higher bar that applies; the additive one where
        neither does, for drawing)."""
        bars = [bar for ok, bar in self._bars(num_tokens) if ok]
        return max(bars) if bars else self._bars(num_tokens)[0][1]

    def eligible(self, num_tokens: float) -> bool:
        """Whether either bar can judge a prompt of this length."""
        return any(ok for ok, _ in self._bars(num_tokens))

    def is_fast(self, num_tokens: float, ttft_ms: float) -> bool:
        return self.eligible(num_tokens) and ttft_ms < self.threshold(num_tokens)

    def _bars(self, n: float) -> tuple[tuple[bool, float], tuple[bool, float]]:
        f, k, low, intercept = self.fraction, self.num_sigmas, self.slope_low, self.intercept_ms
        prefill_ok = low * n >= self.min_prefill_ms and low > 0
        additive = intercept + f * low * n - k * self.scale_ms
        additive_ok = prefill_ok and f * low * n >= 2 * k * self.scale_ms
        proportional = f * (intercept + low * n)
        proportional_ok = (
            prefill_ok
            and proportional >= intercept
            and self.predict(n) - proportional >= k * self.scale_ms
        )
        return (additive_ok, additive), (proportional_ok, proportional)

    @property
    def min_eligible_tokens(self) -> float:
        """The shortest prompt either bar applies to (inf if the slope is zero)."""
        f, k, low, high = self.fraction, self.num_sigmas, self.slope_low, self.ms_per_token
        intercept, scale = self.intercept_ms, self.scale_ms
        if low <= 0:
            return float("inf")
        by_prefill = self.min_prefill_ms / low
        additive = max(by_prefill, 2 * k * scale / (f * low))
        by_intercept = max(intercept, 0.0) * (1 - f) / (f * low)
        by_noise = (k * scale - (1 - f) * intercept) / (high - f * low)
        proportional = max(by_prefill, by_intercept, by_noise)
        return max(0.0, min(additive, proportional))

    @property
    def rule(self) -> str:
        return (
            f"flag when ttft < the higher of intercept + {self.fraction:g} x ms_per_token_low x n"
            f" - {self.num_sigmas:g} x scale and {self.fraction:g} x (intercept + "
            f"ms_per_token_low x n), where each applies; from {self.min_eligible_tokens:.0f} "
            "tokens"
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
            ms_per_token_low=_optional_float(values.get("ms_per_token_low")),
        )

    def to_dict(self) -> dict[str, float | int | str]:
        """Plain values for summary.json and reports."""
        return {
            "intercept_ms": self.intercept_ms,
            "ms_per_token": self.ms_per_token,
            "ms_per_token_low": self.slope_low,
            "scale_ms": self.scale_ms,
            "num_samples": self.num_samples,
            "num_sigmas": self.num_sigmas,
            "fraction": self.fraction,
            "min_prefill_ms": self.min_prefill_ms,
            "min_eligible_tokens": self.min_eligible_tokens,
            "method": self.method,
            "rule": self.rule,
        }


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)

"""The timing detector's model of a target: TTFT as a line in prompt tokens, and the rule
that turns it into a `fast_prefill` verdict.

It is part of the run's vocabulary because three sides read the same line: the timing
detector fits it (`harness.detectors.timing`), the journal records the fit the detector
used (`TimingFitted`), and reports and the plugin's checks draw and apply exactly that line.
This module knows the arithmetic of the rule; it does not fit anything.
"""

from __future__ import annotations

import math
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

    Flagging and passing are not symmetric. A delay never makes an answer faster, so a TTFT
    under the bar is a skipped prefill however loaded the machine (`can_flag`). But a
    skipped prefill answers at about I + the delay contention adds, and where that delay can
    lift it over the bar, an answer above the bar proves nothing: a length is *judged*
    (`eligible`: an answer there that is not flagged passes) only where, besides, the bar
    stands `contention_ms` above I: bar(n) - I >= contention_ms.
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
    contention_ms: float = 0.0
    """The delay contention adds that a skipped prefill would get too: a high quantile
    (`contention_quantile`) of the fit set's residuals above the uncontended line, at least 0
    (0 in journals from before it)."""
    contention_quantile: float = 0.9
    """The quantile of those residuals `contention_ms` is."""

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

    def can_flag(self, num_tokens: float) -> bool:
        """Whether a bar applies to this length: an answer under it was not prefilled."""
        return any(ok for ok, _ in self._bars(num_tokens))

    def eligible(self, num_tokens: float) -> bool:
        """Whether the rule judges a prompt of this length: a bar applies, and it stands
        `contention_ms` above the intercept, so that a skipped prefill delayed by the
        contention the fit shows still falls under it (an answer above it then passes)."""
        return self.can_flag(num_tokens) and self.margin(num_tokens) >= self.contention_ms

    def margin(self, num_tokens: float) -> float:
        """How far the bar stands above the intercept, where a skipped prefill answers."""
        return self.threshold(num_tokens) - self.intercept_ms

    def why_unjudged(self, num_tokens: int, *, over_limit: str | None = None) -> str:
        """Why the rule does not judge `num_tokens` tokens: contention (a bar applies, but a
        skipped prefill delayed as much as the fit set's answers would clear it) or TTFT noise.

        `over_limit` names the unflagged over-limit answers concerned ("2 of 4 answered
        over-limit prompt(s)"); None: `num_tokens` is the longest answered prompt.
        """
        bar = self.min_eligible_tokens
        applies = (
            "never (the fitted slope is 0)" if bar == float("inf") else f"from {bar:.0f} tokens"
        )
        if self.can_flag(num_tokens):
            what = (
                f"{over_limit} were not flagged there"
                if over_limit
                else "nothing was flagged, and the longest answered prompt is that long"
            )
            return (
                f"contention (delays up to {self.contention_ms:.0f} ms, the fit set's "
                f"{100 * self.contention_quantile:g}th percentile, exceed the bar's margin of "
                f"{self.margin(num_tokens):.0f} ms at {num_tokens} tokens, so a skipped prefill "
                f"could answer above the bar): {what}; the rule judges {applies}"
            )
        if over_limit:
            return (
                f"{over_limit} are too short for the rule next to the TTFT noise "
                f"({self.scale_ms:.0f} ms): it applies {applies}, the shortest had {num_tokens}"
            )
        return (
            f"TTFT noise ({self.scale_ms:.0f} ms) hides the prefill of every answered prompt: the "
            f"rule applies {applies}, the longest answered prompt had {num_tokens}"
        )

    def is_fast(self, num_tokens: float, ttft_ms: float) -> bool:
        return self.can_flag(num_tokens) and ttft_ms < self.threshold(num_tokens)

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
        """The shortest prompt the rule judges (`eligible`; inf if the slope is zero)."""
        f, k, low, high = self.fraction, self.num_sigmas, self.slope_low, self.ms_per_token
        intercept, scale, delay = self.intercept_ms, self.scale_ms, self.contention_ms
        if low <= 0:
            return float("inf")
        by_prefill = self.min_prefill_ms / low
        additive = max(by_prefill, max(2 * k * scale, k * scale + delay) / (f * low))
        by_intercept = max((1 - f) * intercept + delay, 0.0) / (f * low)
        by_noise = (k * scale - (1 - f) * intercept) / (high - f * low)
        proportional = max(by_prefill, by_intercept, by_noise)
        return max(0.0, min(additive, proportional))

    @property
    def rule(self) -> str:
        return (
            f"flag when ttft < the higher of intercept + {self.fraction:g} x ms_per_token_low x n"
            f" - {self.num_sigmas:g} x scale and {self.fraction:g} x (intercept + "
            f"ms_per_token_low x n), where each applies; an answer above it passes where the "
            f"bar stands {self.contention_ms:.0f} ms (contention) above the intercept, from "
            f"{self.min_eligible_tokens:.0f} tokens"
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TtftModel:
        """The model `to_dict` wrote (derived entries such as `rule` are ignored); a
        `ValueError` for anything else (a journal is input: it may be damaged)."""
        try:
            model = cls(
                intercept_ms=float(values["intercept_ms"]),
                ms_per_token=float(values["ms_per_token"]),
                scale_ms=float(values["scale_ms"]),
                num_samples=int(values["num_samples"]),
                num_sigmas=float(values["num_sigmas"]),
                fraction=float(values["fraction"]),
                min_prefill_ms=float(values["min_prefill_ms"]),
                method=str(values.get("method", "siegelslopes")),
                ms_per_token_low=_optional_float(values.get("ms_per_token_low")),
                contention_ms=float(values.get("contention_ms", 0.0)),
                contention_quantile=float(values.get("contention_quantile", 0.9)),
            )
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"not a TTFT model: {type(exc).__name__}: {exc}") from None
        model.check()
        return model

    def check(self) -> None:
        """`ValueError` unless every figure is finite and in the range a fit gives."""
        figures = [self.intercept_ms, self.ms_per_token, self.scale_ms, self.num_sigmas]
        figures += [self.fraction, self.min_prefill_ms, self.contention_ms, self.slope_low]
        if not all(math.isfinite(figure) for figure in figures):
            raise ValueError("not a TTFT model: a figure is not finite")
        if not (
            0 < self.fraction < 1
            and self.num_sigmas > 0
            and self.scale_ms > 0
            and self.ms_per_token >= 0
            and self.slope_low >= 0
            and self.min_prefill_ms >= 0
            and self.contention_ms >= 0
            and 0.5 <= self.contention_quantile <= 1
            and self.num_samples >= 0
        ):
            raise ValueError("not a TTFT model: a figure is out of range")

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
            "contention_ms": self.contention_ms,
            "contention_quantile": self.contention_quantile,
            "min_eligible_tokens": self.min_eligible_tokens,
            "method": self.method,
            "rule": self.rule,
        }


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)

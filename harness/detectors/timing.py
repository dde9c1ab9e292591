"""The timing detector: a time-to-first-token too short for a real prefill of the prompt.

Every prompt starts with a request-unique canary, so no legitimate prefix-cache hit can
shorten its prefill: the first token of an N-token prompt cannot arrive before the target
has computed N tokens of KV. A target that skips the prefill (the incident: a placeholder
prompt, pages copied from elsewhere) answers long prompts about as fast as short ones.

The model, fitted on the run's own traffic:

    ttft_ms(n) = intercept_ms + ms_per_token * n + noise

- **Fit set.** Only requests the target really processed: a plan expected to be accepted,
  a 2xx status without error (an intentional disconnect after the first token counts), a
  first token, and `usage.prompt_tokens` absent or within `usage_tolerance` (relative) of
  the tokens sent. Over-limit probes and `prompt_tokens=1` answers never enter the fit, so
  a vulnerable target's fast answers cannot drag the line down. At most `max_fit_samples`
  are kept (a seeded reservoir sample), which bounds the cost of a refit in long soaks.
- **Fit.** Siegel's repeated-medians line (`scipy.stats.siegelslopes`, 50% breakdown: up to
  half the fit set may be outliers such as queueing spikes), the slope clamped at >= 0.
  The intercept and `scale_ms` are read from the *fast side* of the residuals: scale =
  (Q25 - Q05) / 0.9704 and intercept = Q25 + 0.6745 x scale, floored at `min_scale_ms`.
  Contention (client or server CPU, queueing) only ever delays a first token, so the slow
  side says nothing about how fast a real prefill can be; a median line and a symmetric MAD
  drift up under load until no prompt is long enough to judge. For noise without contention
  these equal the median line and the usual sigma; the line is the *uncontended* TTFT.
  The fit needs `min_samples` samples of at least two distinct prompt
  lengths; it is refitted each time the fit set grows by a quarter, and once more at
  `finish()`.
- **Rule** (`harness.record.ttft_model.TtftModel`, where it is written down in full): an
  answer is flagged `fast_prefill` (high) when its TTFT is under `fraction` (0.5) of the
  uncontended TTFT the fit predicts for its length, using the slope's 99 % lower confidence
  bound (Theil-Sen); only for lengths where that bar stands above the intercept and a real
  prefill sits `num_sigmas` (4) noise scales above it. The bar is multiplicative: contention
  widens the spread but never makes an answer faster, so under a CPU hog the bar keeps
  its place instead of sinking below zero.
- **Contention.** A delay never makes an answer faster, so a TTFT under the bar is flagged
  however loaded the machine; but a skipped prefill answers at about intercept + the delay
  contention adds, so an answer *above* the bar passes only where no such delay could have
  lifted a skipped prefill over it. The delays are the fit set's residuals above the
  uncontended line (queueing and CPU contention, plus noise), and the fit journals their
  90th percentile as `contention_ms` (`contention_quantile`): a length is judged only where
  bar(n) - intercept >= contention_ms. Two guards, because two things pass: an answered
  over-limit probe (the incident skipped those, and every one must be flagged) is passed
  only if its TTFT is also more than the run's *largest* delay above the intercept, else it
  is not judged; a length (check 6: the largest accepted prompt) is passed by its fastest
  answer, which a skipped prefill reaches above the bar only if all its k answers were
  delayed past the margin: probability <= 0.1^k. Q90 rather than Q95 because the per-probe
  guard already holds each probe to the maximum, and every extra point of quantile makes
  check 6 skip more often on a merely busy machine; not the maximum for lengths because one
  stall (a GC pause, a burst from another process) would silence timing for the run. The
  margin only ever costs judgements, never flags.
- **Candidates.** Every response with a 2xx status and a first token, including over-limit
  probes (they must be flagged when answered fast).

`observe()` flags online once the fit holds `min_online_samples` (32) samples, so that a
fit of the first few answers (often all slowed by the first concurrent batch) never judges;
`finish()` re-evaluates every candidate not yet flagged against the final fit, which needs
`min_samples` (8). `is_deferred(request_id)` says whether a request's judgement was put off
to `finish()` because the fit was too small to judge it online (the runner holds that
request's `unsafe_accept` until then, so a final `fast_prefill` makes it critical). Where
no fit exists, or no answered prompt is long enough for the rule, `not_judged` says why
(journaled with the model; reports and check 6 say "not judged"): no fit; an answered
over-limit prompt not flagged where the rule does not judge its length (TTFT noise, or
contention delays larger than the bar's margin there), or not flagged but within the run's
largest delay of the intercept; or nothing flagged and the longest answered prompt not
judged. A request is flagged at
most once, and an online flag is never withdrawn even if the final fit would not repeat it.
In soaks, candidates kept for re-evaluation are capped at `max_retained`: past it, those at
or above the current lower bound (which no plausible final fit would flag) are dropped,
then the oldest.

It deliberately knows nothing about response text or status semantics (content and
protocol detectors), and does not test cross-tenant prefix-cache sharing (a paired
timing test, not a per-request rule).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.detectors.ttft_fit import fit_ttft
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.record.ttft_model import TtftModel
from kvcanary.tenants.plan import RequestPlan

DETECTOR = "timing"


@runtime_checkable
class DefersJudgement(Protocol):
    """A timing checker that can say which answers it judges only at the end of the run."""

    def is_deferred(self, request_id: str) -> bool: ...


_REFIT_GROWTH = 1.25


@dataclass(frozen=True, slots=True)
class _Candidate:
    """What a fast_prefill finding needs from one served request (kept for re-evaluation)."""

    request_id: str
    tenant: str
    num_prompt_tokens: int
    ttft_ms: float
    expected: str
    size_label: str
    status: int | None
    usage_prompt_tokens: int | None


class TimingDetector:
    """Fits TTFT against prompt length on honest traffic and flags prefills that were skipped."""

    def __init__(
        self,
        *,
        min_samples: int = 8,
        min_online_samples: int = 32,
        num_sigmas: float = 4.0,
        fraction: float = 0.5,
        min_prefill_ms: float = 5.0,
        min_scale_ms: float = 0.5,
        usage_tolerance: float = 0.1,
        max_fit_samples: int = 1000,
        max_retained: int = 100_000,
        contention_quantile: float = 0.9,
        seed: int = 0,
    ) -> None:
        if min_samples < 3:
            raise ConfigError(f"timing: min_samples must be at least 3, got {min_samples}")
        if not 0 < fraction < 1:
            raise ConfigError(f"timing: fraction must be in (0, 1), got {fraction}")
        if num_sigmas <= 0 or min_scale_ms <= 0 or min_prefill_ms < 0 or usage_tolerance < 0:
            raise ConfigError("timing: sigmas and scale floor must be > 0, tolerances >= 0")
        if max_fit_samples < min_samples or max_retained < 1:
            raise ConfigError("timing: max_fit_samples must be >= min_samples, max_retained >= 1")
        if not 0.5 <= contention_quantile <= 1:
            raise ConfigError(
                f"timing: contention_quantile must be in [0.5, 1], got {contention_quantile}"
            )
        self.contention_quantile = contention_quantile
        self.min_samples = min_samples
        self.min_online_samples = max(min_online_samples, min_samples)
        self._longest_served = 0
        self._over_limit_served: Counter[int] = Counter()
        """Answered over-limit prompts by length: the ones the incident skipped."""
        self._over_limit_open: dict[str, tuple[int, float]] = {}
        """Answered over-limit prompts not flagged (yet): request id -> (tokens, TTFT ms)."""
        self._max_delay_ms = 0.0
        """The largest residual above the current fit's uncontended line."""
        self.num_sigmas = num_sigmas
        self.fraction = fraction
        self.min_prefill_ms = min_prefill_ms
        self.min_scale_ms = min_scale_ms
        self.usage_tolerance = usage_tolerance
        self.max_fit_samples = max_fit_samples
        self.max_retained = max_retained
        self.num_fit_seen = 0
        """Requests that qualified for the fit (the reservoir holds at most max_fit_samples)."""
        self.num_candidates = 0
        self._rng = random.Random(seed)
        self._fit_tokens: list[float] = []
        self._fit_ttft_ms: list[float] = []
        self._fitted_at = 0
        self._model: TtftModel | None = None
        self._retained: list[_Candidate] = []
        self._flagged: set[str] = set()
        self._deferred: set[str] = set()
        """Requests observed while the fit was too small to judge online (until `finish()`)."""

    @property
    def model(self) -> TtftModel | None:
        """The current fit (the final one after `finish()`), or None if there is none yet."""
        return self._model

    @property
    def not_judged(self) -> str | None:
        """Why timing could not judge this run's answers so far, or None when it could."""
        model = self._model
        if model is None:
            return (
                f"no TTFT fit: fewer than {self.min_samples} answered prompts of at least two "
                f"lengths ({self.num_fit_seen} so far)"
            )
        if self._longest_served == 0:
            return "no answer had a first token"
        open_probes = list(self._over_limit_open.values())
        num_served = self._over_limit_served.total()
        unjudged = [n for n, _ in open_probes if not model.eligible(n)]
        if unjudged:
            who = f"{len(unjudged)} of {num_served} answered over-limit prompt(s)"
            return model.why_unjudged(min(unjudged), over_limit=who)
        delay = self._max_delay_ms
        delayed = sum(1 for _, ttft in open_probes if ttft - model.intercept_ms <= delay)
        if delayed:
            return (
                f"contention (delays up to {delay:.0f} ms above the uncontended TTFT): "
                f"{delayed} of {num_served} answered over-limit prompt(s) were not flagged "
                "but came within that delay of the intercept, as a skipped prefill delayed "
                "by it would"
            )
        if not self._flagged and not model.eligible(self._longest_served):
            return model.why_unjudged(self._longest_served)
        return None

    def observe(self, plan: RequestPlan, obs: Observation) -> list[Finding]:
        """Take one finished request; returns a finding if the current fit already flags it."""
        assert plan.request_id == obs.request_id, "observation does not belong to this plan"
        ttft_ns = obs.ttft_ns
        if ttft_ns is None or ttft_ns < 0 or obs.status is None or not 200 <= obs.status < 300:
            return []
        ttft_ms = ttft_ns / 1e6
        if self._qualifies_for_fit(plan, obs):
            self._add_fit_sample(plan.num_prompt_tokens, ttft_ms)
            if self._due_for_refit():
                self._refit()
        candidate = _Candidate(
            request_id=plan.request_id,
            tenant=plan.tenant,
            num_prompt_tokens=plan.num_prompt_tokens,
            ttft_ms=ttft_ms,
            expected=plan.expected,
            size_label=plan.size_label,
            status=obs.status,
            usage_prompt_tokens=obs.usage.prompt_tokens,
        )
        self.num_candidates += 1
        self._longest_served = max(self._longest_served, plan.num_prompt_tokens)
        if plan.expected == "reject":
            self._over_limit_served[plan.num_prompt_tokens] += 1
            self._over_limit_open[plan.request_id] = (plan.num_prompt_tokens, ttft_ms)
        finding = self._evaluate(candidate, when="online")
        if finding is not None:
            return [finding]
        self._cap_over_limit_open()
        if self._model is None or self._model.num_samples < self.min_online_samples:
            self._deferred.add(plan.request_id)
        self._retain(candidate)
        return []

    def is_deferred(self, request_id: str) -> bool:
        """Whether `request_id`'s answer is judged only by `finish()` (the fit was too small
        to judge it online) and has not been judged yet."""
        return request_id in self._deferred

    def finish(self) -> list[Finding]:
        """Refit on everything and flag every not-yet-flagged candidate the final fit flags."""
        if self.num_fit_seen != self._fitted_at:
            self._refit()
        findings = []
        for candidate in self._retained:
            finding = self._evaluate(candidate, when="final")
            if finding is not None:
                findings.append(finding)
        self._retained = [c for c in self._retained if c.request_id not in self._flagged]
        self._deferred.clear()
        return findings

    # -- fit ------------------------------------------------------------------------------

    def _qualifies_for_fit(self, plan: RequestPlan, obs: Observation) -> bool:
        if plan.expected != "accept" or obs.error_kind not in (None, "disconnected"):
            return False
        reported = obs.usage.prompt_tokens
        if reported is None:
            return True
        return abs(reported - plan.num_prompt_tokens) <= self.usage_tolerance * max(
            plan.num_prompt_tokens, 1
        )

    def _add_fit_sample(self, num_tokens: int, ttft_ms: float) -> None:
        self.num_fit_seen += 1
        if len(self._fit_tokens) < self.max_fit_samples:
            self._fit_tokens.append(float(num_tokens))
            self._fit_ttft_ms.append(ttft_ms)
            return
        slot = self._rng.randrange(self.num_fit_seen)  # Algorithm R: uniform over all seen
        if slot < self.max_fit_samples:
            self._fit_tokens[slot] = float(num_tokens)
            self._fit_ttft_ms[slot] = ttft_ms

    def _due_for_refit(self) -> bool:
        if self.num_fit_seen < self.min_samples:
            return False
        return self._model is None or self.num_fit_seen >= _REFIT_GROWTH * self._fitted_at

    def _refit(self) -> None:
        self._fitted_at = self.num_fit_seen
        if len(self._fit_tokens) < self.min_samples:
            return
        x = np.asarray(self._fit_tokens)
        y = np.asarray(self._fit_ttft_ms)
        if np.unique(x).size < 2:  # a slope needs two prompt lengths; wait for more traffic
            self._fitted_at = 0 if self._model is None else self._fitted_at
            return
        self._model, self._max_delay_ms = fit_ttft(
            x,
            y,
            num_sigmas=self.num_sigmas,
            fraction=self.fraction,
            min_prefill_ms=self.min_prefill_ms,
            min_scale_ms=self.min_scale_ms,
            contention_quantile=self.contention_quantile,
        )

    # -- verdicts -------------------------------------------------------------------------

    def _evaluate(self, candidate: _Candidate, *, when: str) -> Finding | None:
        model = self._model
        if model is None or candidate.request_id in self._flagged:
            return None
        if when == "online" and model.num_samples < self.min_online_samples:
            return None  # judged at the end, against the full fit
        if not model.is_fast(candidate.num_prompt_tokens, candidate.ttft_ms):
            return None
        self._flagged.add(candidate.request_id)
        self._over_limit_open.pop(candidate.request_id, None)
        return _finding(candidate, model, when)

    def _cap_over_limit_open(self) -> None:
        """Past `max_retained`, keep the fastest half: only fast ones can make a run not judged."""
        if len(self._over_limit_open) <= self.max_retained:
            return
        fastest = sorted(self._over_limit_open.items(), key=lambda item: item[1][1])
        self._over_limit_open = dict(fastest[: max(self.max_retained // 2, 1)])

    def _retain(self, candidate: _Candidate) -> None:
        self._retained.append(candidate)
        if len(self._retained) <= self.max_retained:
            return
        model = self._model
        if model is not None:
            self._retained = [
                c
                for c in self._retained
                if c.ttft_ms < model.lower_bound(c.num_prompt_tokens)
                and c.request_id not in self._flagged
            ]
        if len(self._retained) > self.max_retained:
            self._retained = self._retained[-(self.max_retained // 2) :]
        if self._deferred:  # a candidate no longer kept is not judged at the end either
            self._deferred &= {c.request_id for c in self._retained}


def _finding(c: _Candidate, model: TtftModel, when: str) -> Finding:
    predicted = model.predict(c.num_prompt_tokens)
    threshold = model.threshold(c.num_prompt_tokens)
    expected = " over-limit" if c.expected == "reject" else ""
    summary = (
        f"{c.tenant}'s {c.request_id} ({c.num_prompt_tokens}-token{expected} prompt) got its "
        f"first token after {c.ttft_ms:.1f} ms, but a real prefill takes about "
        f"{predicted:.1f} ms (flagged below {threshold:.1f} ms): the prompt was not prefilled"
    )
    return Finding.on_request(
        FindingKind.FAST_PREFILL,
        DETECTOR,
        c.request_id,
        c.tenant,
        summary,
        {
            "ttft_ms": c.ttft_ms,
            "predicted_ms": predicted,
            "lower_bound_ms": model.lower_bound(c.num_prompt_tokens),
            "threshold_ms": threshold,
            "num_prompt_tokens": c.num_prompt_tokens,
            "usage_prompt_tokens": c.usage_prompt_tokens,
            "expected": c.expected,
            "size_label": c.size_label,
            "status": c.status,
            "evaluated": when,
            "model": model.to_dict(),
        },
    )

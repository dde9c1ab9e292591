"""The cross-tenant prefix-cache timing probe: trial design, sending, and the assessment.

Gu et al.'s audit ("Auditing Prompt Caching in Language Model APIs", ICML 2025) with paired
controls (vLLM PR #53347). For every ordered tenant pair (owner A, prober B) in a ring over
the tenants, trials of four kinds, all interleaved in one seeded random order:

    same_tenant   A sends prefix + s1, then A sends prefix + s2; the second is timed.
                  The positive control: a working cache must serve it (owners rotate).
    cross_tenant  A sends prefix + s1, then B sends prefix + s2; B's request is timed.
    spoofed_salt  as cross_tenant, but B's request carries A's `cache_salt` (only where A
                  has one): can a client-supplied salt select another tenant's cache?
    miss          B sends a fresh prefix + s; the negative control and every baseline.

Prompts are exact in the target's tokenizer: `num_prompt_tokens` tokens, of which the first
`num_prefix_tokens` (a whole number of pages) are the shared prefix. Prefix and suffix are
canary-laced text (`canaries.build_prompt`) from a probe-only minter, so every prefix is
fresh (its first tokens are a unique canary) and every suffix differs from the start of its
first canary's words; the tokens of each prompt are checked to begin with exactly the
prefix's tokens. Requests are sent one at a time with `max_tokens=1`, after a few unmeasured
warm-up requests; only the timed request's TTFT enters the statistics, and a trial whose
seed request failed is dropped (its prefix may not be cached).

Everything sent and seen can be journaled through `emit` (phase `cache_probe`, plans with
intent `control`, observations with their one-token text dropped, findings, and last a
`ProbeFinished` event with the verdict and statistics). The statistics are
`harness.cache_stats`; this module knows nothing about how an engine caches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from canaries import BuiltPrompt, CanaryError, CanaryMinter, Tokenizer, build_prompt
from harness.cache_stats import (
    DEFAULT_ALPHA,
    ArmKind,
    ArmPair,
    ArmSample,
    Assessment,
    Verdict,
    assess,
    findings_of,
)
from harness.errors import ConfigError
from harness.events import (
    Event,
    FindingRecorded,
    ObservationRecorded,
    PhaseStarted,
    PlanRecorded,
    ProbeFinished,
)
from harness.finding import Finding
from harness.observation import Observation
from tenants.plan import ApiStyle, RequestPlan
from tenants.tenant import Tenant

PHASE = "cache_probe"
DEFAULT_NUM_TRIALS = 20
"""Timed trials per arm. Simulated power at the default alpha with 4 contrasts
(benchmarks/RESULTS-cache-probe.md): >= 0.99 for a 2x TTFT speedup under 30% TTFT noise and
for 1.25x under 10%; the bundled engine's hit is ~3-5x faster than a miss."""
DEFAULT_PROMPT_TOKENS = 1024
DEFAULT_PREFIX_FRACTION = 0.875
DEFAULT_NUM_WARMUP = 2
_LACING_PAGE = 64
"""Canary spacing inside probe prompts: freshness needs only the first canary."""

Arm = Literal["same_tenant", "cross_tenant", "spoofed_salt", "miss"]
Role = Literal["warmup", "seed", "timed"]


class ProbeSender(Protocol):
    """Sends one plan and reports what was seen (`harness.client.TargetClient`)."""

    async def send(
        self,
        plan: RequestPlan,
        tenant: Tenant,
        *,
        t_scheduled_ns: int,
        on_text: Callable[[str], None] | None = None,
    ) -> Observation: ...


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """How the probe is sized and decided."""

    num_trials: int = DEFAULT_NUM_TRIALS
    """Timed trials per arm: per tenant pair for cross arms, in all for the controls."""
    alpha: float = DEFAULT_ALPHA
    num_prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    prefix_fraction: float = DEFAULT_PREFIX_FRACTION
    page_size: int = 16
    """The target's KV page (block) size: the shared prefix is a whole number of pages."""
    api: ApiStyle = "completions"
    chat_overhead_tokens: int = 0
    """Tokens the target's chat template adds (`api="chat"`), taken from the suffix."""
    seed: int = 0
    num_warmup: int = DEFAULT_NUM_WARMUP
    pause_s: float = 0.0
    """Idle time between requests (remote APIs: let earlier requests drain)."""
    trim_outliers: bool = True
    max_pairs: int | None = None
    """Test at most this many tenant pairs (default: a ring over all tenants)."""
    spoof_salts: bool = True

    def __post_init__(self) -> None:
        if self.num_trials < 5:
            raise ConfigError(
                f"the cache probe needs at least 5 trials per arm, got {self.num_trials}"
            )
        if not 0 < self.alpha < 0.5:
            raise ConfigError(f"alpha must be in (0, 0.5), got {self.alpha}")
        if self.page_size < 1:
            raise ConfigError(f"page size must be positive, got {self.page_size}")
        if not 0 < self.prefix_fraction < 1:
            raise ConfigError(f"prefix fraction must be in (0, 1), got {self.prefix_fraction}")
        if self.num_prefix_tokens < self.page_size:
            raise ConfigError(
                f"a {self.num_prompt_tokens}-token prompt with prefix fraction "
                f"{self.prefix_fraction} holds no whole {self.page_size}-token page of prefix"
            )
        if self.num_suffix_tokens - self.chat_overhead_tokens < 1:
            raise ConfigError(
                f"a {self.num_prompt_tokens}-token prompt leaves no suffix after a "
                f"{self.num_prefix_tokens}-token prefix"
                + (
                    f" and {self.chat_overhead_tokens} chat template tokens"
                    if self.api == "chat"
                    else ""
                )
            )
        if self.num_warmup < 0 or self.pause_s < 0:
            raise ConfigError("warm-up requests and pauses cannot be negative")
        if self.max_pairs is not None and self.max_pairs < 1:
            raise ConfigError(f"max_pairs must be at least 1, got {self.max_pairs}")

    @property
    def num_prefix_tokens(self) -> int:
        pages = math.floor(self.prefix_fraction * self.num_prompt_tokens / self.page_size)
        return pages * self.page_size

    @property
    def num_suffix_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_prefix_tokens

    def to_record(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["num_prefix_tokens"] = self.num_prefix_tokens
        return record


@dataclass(frozen=True, slots=True)
class Send:
    """One request of a trial: the plan and the identity it is sent with."""

    plan: RequestPlan
    tenant: Tenant
    role: Role


@dataclass(frozen=True, slots=True)
class Trial:
    """A seed request (cache arms) and the timed request, for one arm of one pair."""

    index: int
    arm: Arm
    owner: str
    prober: str
    sends: tuple[Send, ...]
    num_shared_tokens: int
    """Leading tokens the timed prompt shares with an earlier one (0 for misses)."""

    @property
    def timed(self) -> Send:
        return self.sends[-1]


@dataclass(frozen=True, slots=True)
class TrialOutcome:
    """What one trial measured."""

    trial: Trial
    ttft_ms: float | None
    """The timed request's TTFT; None when it or its seed failed."""
    cached_tokens: int | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Design:
    """Every trial, in sending order, and the tenant pairs they test."""

    settings: ProbeSettings
    pairs: tuple[tuple[str, str], ...]
    warmup: tuple[Send, ...]
    trials: tuple[Trial, ...]

    @property
    def num_requests(self) -> int:
        return len(self.warmup) + sum(len(t.sends) for t in self.trials)

    def has_arm(self, arm: Arm, owner: str, prober: str) -> bool:
        return any(t.arm == arm and (t.owner, t.prober) == (owner, prober) for t in self.trials)

    def to_record(self) -> dict[str, Any]:
        shared = [t.num_shared_tokens for t in self.trials if t.arm != "miss"]
        return {
            **self.settings.to_record(),
            "pairs": [list(p) for p in self.pairs],
            "num_requests": self.num_requests,
            "num_shared_tokens_min": min(shared, default=0),
            "num_shared_tokens_max": max(shared, default=0),
        }


@dataclass(frozen=True, slots=True)
class CacheProbeResult:
    """The probe's outcome: verdict, statistics, findings and every trial."""

    design: Design
    assessment: Assessment
    findings: tuple[Finding, ...]
    outcomes: tuple[TrialOutcome, ...] = field(repr=False)

    @property
    def verdict(self) -> Verdict:
        return self.assessment.verdict

    def to_details(self) -> dict[str, Any]:
        return {"assessment": self.assessment.to_details(), "design": self.design.to_record()}


# -- design ----------------------------------------------------------------------------


def design_trials(
    tenants: Sequence[Tenant],
    tokenizer: Tokenizer,
    settings: ProbeSettings,
    *,
    minter: CanaryMinter | None = None,
    first_request: int = 0,
) -> Design:
    """The probe's trials for `tenants`, in a random order fixed by `settings.seed`."""
    if len(tenants) < 2:
        raise ConfigError("the cache probe needs at least two tenants (an owner and a prober)")
    if len({t.name for t in tenants}) != len(tenants):
        raise ConfigError("tenant names must be unique")
    builder = _PromptBuilder(
        tokenizer, minter or CanaryMinter.from_seed(settings.seed, "cache-probe"), settings
    )
    builder.next_request = first_request
    ring = [(tenants[i], tenants[(i + 1) % len(tenants)]) for i in range(len(tenants))]
    ring = ring[: settings.max_pairs or len(ring)]
    n = settings.num_trials
    owners = itertools.islice(itertools.cycle(tenants), n)  # the positive control rotates
    specs: list[tuple[Arm, Tenant, Tenant]] = [("same_tenant", t, t) for t in owners]
    for owner, prober in ring:
        arms: list[Arm] = ["cross_tenant", "miss"]
        if settings.spoof_salts and _can_spoof(owner, prober):
            arms.append("spoofed_salt")
        specs += [(arm, owner, prober) for arm in arms for _ in range(n)]
    random.Random(settings.seed).shuffle(specs)
    index = {t.name: i for i, t in enumerate(tenants)}
    trials = tuple(
        builder.trial(k, arm, owner, prober, index) for k, (arm, owner, prober) in enumerate(specs)
    )
    warmup = tuple(
        Send(builder.plan(f"cpw{k:03d}", t, builder.fresh(index[t.name]), "warmup"), t, "warmup")
        for k, t in enumerate(itertools.islice(itertools.cycle(tenants), settings.num_warmup))
    )
    return Design(settings, tuple((o.name, p.name) for o, p in ring), warmup, trials)


def _can_spoof(owner: Tenant, prober: Tenant) -> bool:
    return owner.cache_salt is not None and owner.cache_salt != prober.cache_salt


class _PromptBuilder:
    """Exact-length probe prompts: a page-aligned prefix, then a suffix that diverges."""

    def __init__(self, tokenizer: Tokenizer, minter: CanaryMinter, settings: ProbeSettings):
        self.tokenizer = tokenizer
        self.minter = minter
        self.settings = settings
        self.next_request = 0

    def _piece(self, tenant_index: int, num_tokens: int) -> BuiltPrompt:
        request = self.next_request
        self.next_request += 1
        try:
            return build_prompt(
                self.tokenizer,
                self.minter,
                tenant=tenant_index,
                request=request,
                num_tokens=num_tokens,
                page_size=_LACING_PAGE,
                seed=self.settings.seed,
            )
        except CanaryError as exc:
            raise ConfigError(f"cannot build a cache-probe prompt: {exc}") from None

    def prefix(self, tenant_index: int) -> BuiltPrompt:
        return self._piece(tenant_index, self.settings.num_prefix_tokens)

    def join(self, prefix: BuiltPrompt, tenant_index: int) -> tuple[str, list[int]]:
        """`prefix` plus a fresh suffix; checked to tokenize as the prefix, then the rest."""
        num_suffix = self.settings.num_suffix_tokens - self.settings.chat_overhead_tokens
        text = prefix.text + self._piece(tenant_index, num_suffix).text
        ids = self.tokenizer.encode(text)
        wanted = self.settings.num_prompt_tokens - self.settings.chat_overhead_tokens
        prefix_ids = self.tokenizer.encode(prefix.text)
        if len(ids) != wanted or ids[: len(prefix_ids)] != prefix_ids:
            raise ConfigError(
                f"tokenizer {self.tokenizer.name}: a probe prompt does not tokenize as its "
                "prefix followed by its suffix (tokens merge across the boundary)"
            )
        return text, ids

    def fresh(self, tenant_index: int) -> str:
        return self.join(self.prefix(tenant_index), tenant_index)[0]

    def plan(self, request_id: str, tenant: Tenant, prompt: str, label: str) -> RequestPlan:
        return RequestPlan(
            request_id=request_id,
            tenant=tenant.name,
            phase=PHASE,
            intent="control",
            size_label=f"{PHASE}/{label}",
            num_prompt_tokens=self.settings.num_prompt_tokens,
            expected="accept",
            api=self.settings.api,
            prompt=prompt,
            max_tokens=1,
            prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
        )

    def trial(
        self, k: int, arm: Arm, owner: Tenant, prober: Tenant, index: dict[str, int]
    ) -> Trial:
        if arm == "miss":
            prompt = self.fresh(index[prober.name])
            timed = Send(self.plan(f"cp{k:04d}-miss", prober, prompt, arm), prober, "timed")
            return Trial(k, arm, owner.name, prober.name, (timed,), 0)
        prefix = self.prefix(index[owner.name])
        seed_text, seed_ids = self.join(prefix, index[owner.name])
        timed_text, timed_ids = self.join(prefix, index[prober.name])
        sender = prober
        if arm == "spoofed_salt":
            sender = dataclasses.replace(prober, cache_salt=owner.cache_salt)
        seed = Send(self.plan(f"cp{k:04d}-seed", owner, seed_text, f"{arm}/seed"), owner, "seed")
        timed = Send(self.plan(f"cp{k:04d}-timed", sender, timed_text, arm), sender, "timed")
        return Trial(k, arm, owner.name, prober.name, (seed, timed), _lcp(seed_ids, timed_ids))


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


# -- running ---------------------------------------------------------------------------


class CacheProbe:
    """Sends a design's requests one at a time and assesses what it measured."""

    def __init__(
        self, sender: ProbeSender, design: Design, *, emit: Callable[[Event], None] | None = None
    ) -> None:
        """`emit` journals every plan, observation and finding as it happens."""
        self.sender = sender
        self.design = design
        self._emit = emit

    async def run(self) -> CacheProbeResult:
        self._event(PhaseStarted(PHASE, time.time()))
        for send in self.design.warmup:
            await self._send(send)
        outcomes = [await self._trial(trial) for trial in self.design.trials]
        result = self.assess(outcomes)
        for finding in result.findings:
            self._event(FindingRecorded(finding, time.time()))
        self._event(ProbeFinished(PHASE, result.verdict, result.to_details(), time.time()))
        return result

    def assess(self, outcomes: Sequence[TrialOutcome]) -> CacheProbeResult:
        """The statistics of `outcomes` (also usable on outcomes read back from a journal)."""
        settings = self.design.settings
        positive = ArmPair(
            "same_tenant",
            "*",
            "*",
            _sample(outcomes, "same_tenant"),
            _sample(outcomes, "miss"),
        )
        family = []
        cache_arms: tuple[ArmKind, ...] = ("cross_tenant", "spoofed_salt")
        for owner, prober in self.design.pairs:
            baseline = _sample(outcomes, "miss", owner, prober)
            for kind in cache_arms:
                candidate = _sample(outcomes, kind, owner, prober)
                if self.design.has_arm(kind, owner, prober):
                    family.append(ArmPair(kind, owner, prober, candidate, baseline))
        assessment = assess(
            positive,
            family,
            shared_tokens=_shared_pages(self.design),
            alpha=settings.alpha,
            trim_outliers=settings.trim_outliers,
        )
        findings = findings_of(assessment, self.design.to_record())
        return CacheProbeResult(self.design, assessment, tuple(findings), tuple(outcomes))

    async def _trial(self, trial: Trial) -> TrialOutcome:
        observations = [await self._send(send) for send in trial.sends]
        failed = next((o for o in observations if not o.ok or o.ttft_ns is None), None)
        if failed is not None:
            why = failed.error or f"HTTP {failed.status} without a first token"
            return TrialOutcome(trial, None, None, f"{failed.request_id}: {why}")
        timed = observations[-1]
        assert timed.ttft_ns is not None
        return TrialOutcome(trial, timed.ttft_ns / 1e6, timed.usage.cached_tokens)

    async def _send(self, send: Send) -> Observation:
        if self.design.settings.pause_s:
            await asyncio.sleep(self.design.settings.pause_s)
        self._event(PlanRecorded(send.plan))
        obs = await self.sender.send(
            send.plan, send.tenant, t_scheduled_ns=time.perf_counter_ns(), on_text=None
        )
        # the text is one token of a reply to our own prompt; only its hash is kept
        self._event(ObservationRecorded(dataclasses.replace(obs, text="", text_redacted=True)))
        return obs

    def _event(self, event: Event) -> None:
        if self._emit is not None:
            self._emit(event)


def _sample(
    outcomes: Sequence[TrialOutcome], arm: Arm, owner: str | None = None, prober: str | None = None
) -> ArmSample:
    chosen = [
        o
        for o in outcomes
        if o.trial.arm == arm
        and o.ttft_ms is not None
        and (owner is None or o.trial.owner == owner)
        and (prober is None or o.trial.prober == prober)
    ]
    return ArmSample(
        tuple(o.ttft_ms for o in chosen if o.ttft_ms is not None),
        tuple(o.cached_tokens for o in chosen),
    )


def _shared_pages(design: Design) -> int:
    """Tokens a page-granular cache can serve to a timed request: its shared whole pages."""
    page = design.settings.page_size
    shared = [t.num_shared_tokens for t in design.trials if t.arm != "miss"]
    return min(shared, default=0) // page * page


async def run_cache_probe(
    sender: ProbeSender,
    tenants: Sequence[Tenant],
    tokenizer: Tokenizer,
    settings: ProbeSettings | None = None,
    *,
    emit: Callable[[Event], None] | None = None,
    minter: CanaryMinter | None = None,
) -> CacheProbeResult:
    """Design the trials for `tenants`, send them through `sender`, assess them."""
    design = design_trials(tenants, tokenizer, settings or ProbeSettings(), minter=minter)
    return await CacheProbe(sender, design, emit=emit).run()

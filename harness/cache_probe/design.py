"""The cache probe's trial design: tenant pairs, arms, exact prompts, a seeded order.

Gu et al.'s audit ("Auditing Prompt Caching in Language Model APIs", ICML 2025) with paired
controls (vLLM PR #53347). For every ordered tenant pair (owner A, prober B) in a ring over
the tenants, trials of four kinds, all interleaved in one seeded random order:

    same_tenant   A sends prefix + s1, then A sends prefix + s2; the second is timed.
                  The positive control: a working cache must serve it (owners rotate).
    cross_tenant  A sends prefix + s1, then B sends prefix + s2; B's request is timed.
    spoofed_salt  as cross_tenant, but B's request carries A's `cache_salt` (only where A
                  has one): can a client-supplied salt select another tenant's cache?
    miss          A sends an unrelated fresh prompt, then B sends a fresh prefix + s; B's
                  request is timed. The negative control and every baseline. Every arm's
                  timed request follows exactly one untimed send, so what differs between
                  arms is only whether the prefix was cached, not how warm the path was.

Prompts are exact in the target's tokenizer: `num_prompt_tokens` tokens, of which the first
`num_prefix_tokens` (a whole number of pages) are the shared prefix. Prefix and suffix are
canary-laced text (`canaries.build_prompt`) from a probe-only minter, so every prefix is
fresh (its first tokens are a unique canary) and every suffix differs from its sibling
within its first canary; the tokens of each prompt are checked to begin with exactly the
prefix's tokens. Every request asks for `max_tokens=1`.

It deliberately knows nothing about sending or statistics (`harness.cache_probe.probe`,
`harness.cache_probe.stats`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvcanary.canaries import BuiltPrompt, CanaryError, CanaryMinter, Tokenizer
from kvcanary.canaries.alphabet import alphabet_for
from kvcanary.canaries.errors import ConfigError
from kvcanary.canaries.prompt import PromptRequest, PromptSettings, batch_settings, build_prompts
from kvcanary.harness.cache_probe.stats import DEFAULT_ALPHA
from kvcanary.harness.record.events import Limits
from kvcanary.tenants.plan import ApiStyle, RequestPlan
from kvcanary.tenants.tenant import Tenant

PHASE = "cache_probe"
DEFAULT_NUM_TRIALS = 20
"""Timed trials per arm. Simulated power at the default alpha with 4 contrasts
(benchmarks/RESULTS-cache-probe.md): >= 0.99 for a 2x TTFT speedup under 30% TTFT noise and
for 1.25x under 10%. The bundled engine's hit is ~2.5x faster than a miss over HTTP."""
DEFAULT_PROMPT_TOKENS = 1024
DEFAULT_PREFIX_FRACTION = 0.875
DEFAULT_NUM_WARMUP = 2
_LIMIT_MARGIN = 16
"""Tokens kept below a target's limits (SGLang's own input limit is a few below them)."""
_LACING_PAGE = 64
"""Canary spacing inside probe prompts: freshness needs only the first canary."""

Arm = Literal["same_tenant", "cross_tenant", "spoofed_salt", "miss"]
Role = Literal["warmup", "seed", "timed"]


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


def settings_for(limits: Limits, **fields: Any) -> ProbeSettings:
    """Default settings for a target with `limits`: the page size is the target's, and the
    prompt is shortened where the target's input limit is below the default length."""
    ceiling = min(limits.pool_tokens, limits.context_tokens) - _LIMIT_MARGIN
    if limits.max_input_tokens is not None:
        ceiling = min(ceiling, limits.max_input_tokens - 1)
    fields.setdefault("num_prompt_tokens", min(DEFAULT_PROMPT_TOKENS, ceiling))
    fields.setdefault("page_size", limits.page_size)
    return ProbeSettings(**fields)


def probe_tenants(tenants: Sequence[Tenant], *, salts: bool = False) -> list[Tenant]:
    """The tenants as the probe sends them.

    A tenant without any credential gets its own made-up bearer token (`kvcanary-anon-NAME`,
    not a secret: a server that checks tokens would refuse every anonymous tenant anyway),
    so that a server deriving the cache salt from the credential sees distinct tenants, as
    distinct customers would be. `salts`: each tenant gets its own random `cache_salt` (256
    bits, as vLLM's docs advise), which adds the spoofed-salt arms.
    """
    probed = []
    for tenant in tenants:
        if tenant.api_key_env is None and not tenant.headers:
            token = f"kvcanary-anon-{tenant.name}"
            tenant = dataclasses.replace(tenant, headers={"Authorization": f"Bearer {token}"})
        if salts:
            tenant = dataclasses.replace(tenant, cache_salt=secrets.token_urlsafe(32))
        probed.append(tenant)
    return probed


def shares_credentials(tenants: Sequence[Tenant]) -> bool:
    """Whether some tenants send the same credential: the headers they resolve to now (two
    variables holding one key are one credential; one variable read by all is too)."""
    keys = [tuple(sorted(t.auth_headers().items())) for t in tenants]
    return len(set(keys)) < len(keys)


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
    if minter is None:  # the canaries the run's tokenizer spells shortest
        minter = CanaryMinter.from_seed(
            settings.seed, "cache-probe", alphabet=alphabet_for(tokenizer)
        )
    builder = _PromptBuilder(tokenizer, minter, settings)
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
        # a canary every 64 tokens, or as densely as canaries this long allow (a coarse
        # vocabulary's are longer: `canaries.guarantee`); freshness needs only the first
        self.lacing_page = max(_LACING_PAGE, 2 * minter.num_tokens(tokenizer) - 1)
        self._prompt_settings: PromptSettings | None = None
        """Checked at the first piece, then shared by all (as the planner's are)."""

    def _piece(self, tenant_index: int, num_tokens: int) -> BuiltPrompt:
        wanted = [PromptRequest(tenant_index, self.next_request, num_tokens)]
        self.next_request += 1
        try:
            if self._prompt_settings is None:
                self._prompt_settings = batch_settings(
                    self.tokenizer,
                    self.minter,
                    page_size=self.lacing_page,
                    filler="prose",
                    seed=self.settings.seed,
                )
            return build_prompts(self.tokenizer, self.minter, wanted, self._prompt_settings)[0]
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
            # An untimed send of an unrelated prompt first, as in every other arm: each timed
            # request then follows one untimed request, so a warm path cannot pass for a hit.
            other = self.fresh(index[owner.name])
            seed = Send(self.plan(f"cp{k:04d}-seed", owner, other, "miss/seed"), owner, "seed")
            prompt = self.fresh(index[prober.name])
            timed = Send(self.plan(f"cp{k:04d}-miss", prober, prompt, arm), prober, "timed")
            return Trial(k, arm, owner.name, prober.name, (seed, timed), 0)
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

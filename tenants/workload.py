"""Workload profiles: which prompt sizes victims and probes use, and how long answers may be.

Victims fill the target's KV pool with canary-laced prompts that a safe target accepts;
probes are sized at and above the limits, where a vulnerable target answers from stale pages
instead of rejecting; abort plans drop their connection mid-stream to exercise release paths.
Sizes are expressions over the target's limits (see `tenants.size`), so one profile fits
every deployment. A profile knows nothing about tenants, tokenizers or transport.

Named profiles:

    incident   victims below the limit keep the pool full of canaries; probes from the pool
               to just past the context (the GLM-5.3 incident's shape). The default.
    limits     only the edges: one below, at and one above the pool and the context
    below      everything below the limit: a concurrency contamination check, where any
               foreign canary is a leak without an over-limit prompt to explain it
    race       the page-lifetime race (SGLang #35049): large abort plans, each followed by a
               small victim with a long answer that reads the pages the abort freed
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvcanary.canaries.errors import ConfigError
from kvcanary.tenants.plan import Intent
from kvcanary.tenants.size import LimitsLike, ResolvedSize, SizeSpec, size


@dataclass(frozen=True, slots=True)
class WorkloadProfile:
    """The sizes and answer lengths of one kind of run."""

    name: str
    description: str
    victims: Sequence[SizeSpec]
    probes: Sequence[SizeSpec]
    aborts: Sequence[SizeSpec] = ()
    victim_fraction: float = 0.75
    """In mixed phases (soak), the share of requests that are victims rather than probes."""
    victim_max_tokens: int = 16
    """Victims only need to be prefilled; short answers keep the pool turning over."""
    probe_max_tokens: int = 64
    """Long enough for a probe reading stale pages to quote several complete canaries."""
    abort_after_chunks: int = 0
    """Abort plans drop the connection after this many content chunks (0: after headers).
    0 by default: a stream's head comes before the first token on SGLang-style servers, so an
    abort right after it can land while the request's KV is still being prefilled or written
    (the page-lifetime race, SGLang #35049); after the first token the write has landed."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "victims", tuple(self.victims))
        object.__setattr__(self, "probes", tuple(self.probes))
        object.__setattr__(self, "aborts", tuple(self.aborts))
        if not self.victims and not self.probes:
            raise ConfigError(f"workload profile {self.name!r} has no victim or probe sizes")
        if not 0.0 <= self.victim_fraction <= 1.0:
            raise ConfigError(f"profile {self.name!r}: victim_fraction must be within [0, 1]")
        if self.victim_max_tokens < 1 or self.probe_max_tokens < 1:
            raise ConfigError(f"profile {self.name!r}: max_tokens must be at least 1")
        if self.abort_after_chunks < 0:
            raise ConfigError(f"profile {self.name!r}: abort_after_chunks must be >= 0")

    def max_tokens(self, intent: Intent) -> int:
        """The answer length a plan of `intent` asks for."""
        # an abort plan must still be streaming when it drops: it asks for a probe's length
        return self.victim_max_tokens if intent == "victim" else self.probe_max_tokens

    def resolve(self, limits: LimitsLike) -> ResolvedWorkload:
        """Every size of this profile in tokens, with its expected outcome, for one target."""

        def sizes(specs: Sequence[SizeSpec]) -> tuple[ResolvedSize, ...]:
            return tuple(s.resolve(limits, self.max_tokens(s.intent)) for s in specs)

        return ResolvedWorkload(sizes(self.victims), sizes(self.probes), sizes(self.aborts))


@dataclass(frozen=True, slots=True)
class ResolvedWorkload:
    """A profile's sizes against one target's limits."""

    victims: tuple[ResolvedSize, ...]
    probes: tuple[ResolvedSize, ...]
    aborts: tuple[ResolvedSize, ...] = field(default=())


def _specs(intent: Intent, *exprs: str) -> tuple[SizeSpec, ...]:
    return tuple(size(expr, intent) for expr in exprs)


INCIDENT = WorkloadProfile(
    name="incident",
    description="victims fill the pool below the limit; probes from the pool past the context",
    victims=_specs("victim", "0.5*limit", "0.25*limit", "0.125*limit", "limit-1"),
    probes=_specs(
        "probe", "pool", "pool+1", "(pool+context)/2", "context-1", "context", "context+1"
    ),
    aborts=_specs("abort", "0.5*limit"),
)

LIMITS = WorkloadProfile(
    name="limits",
    description="edge sizes only: one below, at and one above the pool and the context",
    victims=_specs("victim", "limit-1"),
    probes=_specs("probe", "pool-1", "pool", "pool+1", "context-1", "context", "context+1"),
    victim_fraction=0.25,
)

BELOW = WorkloadProfile(
    name="below",
    description="every prompt below the limit: concurrency contamination check",
    victims=_specs("victim", "0.25*limit", "0.5*limit", "limit-1"),
    probes=_specs("probe", "0.125*limit", "0.75*limit", "limit-1"),
    victim_fraction=0.5,
)

RACE = WorkloadProfile(
    name="race",
    description="large aborts, each followed by a small victim with a long answer",
    # An abort of 0.9x the limit nearly fills the smallest pool, so the next request finds
    # the free list short and (in SGLang's sorted PD order) is handed the aborted request's
    # pages; its own write is 7x smaller and lands first, the aborted request's late write
    # then lands on it, and its 256-token answer is still being decoded over those pages.
    victims=_specs("victim", "0.125*limit"),
    # probes within the limits make the run a within-limits check (clean, not inconclusive,
    # when nothing leaks); this few of them never follow an abort in the smooth round robin
    probes=_specs("probe", "0.125*limit"),
    aborts=_specs("abort", "0.9*limit"),
    victim_fraction=0.9,
    victim_max_tokens=256,
)

PROFILES: Mapping[str, WorkloadProfile] = MappingProxyType(
    {profile.name: profile for profile in (INCIDENT, LIMITS, BELOW, RACE)}
)


def get_profile(name: str) -> WorkloadProfile:
    """A named profile, or ConfigError listing the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(
            f"unknown workload profile {name!r}; choose one of {', '.join(PROFILES)}"
        ) from None


def profile_names() -> Sequence[str]:
    """Names of the built-in profiles, default first."""
    return tuple(PROFILES)

"""The planner: turns tenants and a workload profile into request plans with exact prompts.

For each plan it picks a tenant (weighted by `Tenant.weight`, deterministic from the seed),
numbers the request, and builds a canary-laced prompt of exactly the planned token count
with `canaries.build_prompt`; the tenant's index and the request number go into the
minter, so every canary says whose request it came from. The first tokens of every prompt
are a request-unique canary, so no legitimate prefix-cache hit exists between two plans.

Two prompt styles, both exact:

    completions  the laced text is the whole prompt: `num_tokens` tokens.
    chat         the user message is the laced text, then an instruction asking the model to
                 repeat what it read (a real model reading stale pages then says so). The
                 instruction and the chat template's overhead (`chat_overhead_tokens`, in the
                 target's tokenizer) count toward the total, so the server should report
                 `usage.prompt_tokens == num_tokens`.

The planner knows nothing about transport, timing or detection; it is not thread-safe
(one run drives it from one event loop).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator, Sequence

from kvcanary.canaries import (
    BuiltPrompt,
    CanaryError,
    CanaryIndex,
    CanaryMinter,
    CanaryOrigin,
    CanarySpan,
    Owner,
    Tokenizer,
    build_prompt,
)
from kvcanary.canaries.errors import ConfigError
from kvcanary.canaries.prompt import Filler
from kvcanary.tenants.plan import ApiStyle, Intent, RequestPlan
from kvcanary.tenants.size import LimitsLike, ResolvedSize, SizeSpec
from kvcanary.tenants.tenant import Tenant
from kvcanary.tenants.workload import ResolvedWorkload, WorkloadProfile

CHAT_INSTRUCTION = "Repeat the text above exactly, word for word, from its first word to its last."
"""Comes after the laced text so that the prompt still opens with its request's canary."""
_SEPARATORS = (" \n\n", "\n\n", "\n")
"""Between the laced text and the instruction, in order of preference. The first never
merges with the text's last token in cl100k (the text ends in a letter or punctuation, and
a space starts a new pre-token); other tokenizers may merge, so the others are fallbacks."""
_SIZE_NUDGES = (0, -1, 1, -2, 2)


def request_id(tenant_index: int, request: int) -> str:
    return f"t{tenant_index}-r{request:06d}"


def max_tokens_for(profile: WorkloadProfile, intent: Intent) -> int:
    """The answer length a plan of `intent` asks for."""
    # an abort plan must still be streaming when it drops: it asks for a probe's length
    return profile.victim_max_tokens if intent == "victim" else profile.probe_max_tokens


def abort_sizes(workload: ResolvedWorkload) -> tuple[ResolvedSize, ...]:
    """The abort stream's sizes: the profile's, else its first victim size."""
    return workload.aborts or tuple(
        ResolvedSize(v.label, v.expr, "abort", v.num_tokens, v.expected)
        for v in workload.victims[:1]
    )


def sketch_streams(
    profile: WorkloadProfile, limits: LimitsLike, api: ApiStyle
) -> dict[Intent, Iterator[RequestPlan]]:
    """The planner's three streams as plans without prompts, sizes in the same order.

    What a run will cost is known from these before a tokenizer, a key or the target is at
    hand: a plan's size and answer length do not depend on its tenant or its text.
    """
    workload = profile.resolve(limits)
    sizes: dict[Intent, tuple[ResolvedSize, ...]] = {
        "victim": workload.victims,
        "probe": workload.probes,
        "abort": abort_sizes(workload),
    }
    return {
        intent: (_sketch(profile, spec, api) for spec in _cycle(specs, None))
        for intent, specs in sizes.items()
    }


def _sketch(profile: WorkloadProfile, spec: ResolvedSize, api: ApiStyle) -> RequestPlan:
    return RequestPlan(
        request_id="",
        tenant="",
        phase="",
        intent=spec.intent,
        size_label=spec.label,
        num_prompt_tokens=spec.num_tokens,
        expected=spec.expected,
        api=api,
        prompt="",
        max_tokens=max_tokens_for(profile, spec.intent),
    )


def _cycle(sizes: Sequence[ResolvedSize], rounds: int | None) -> Iterator[ResolvedSize]:
    """`sizes` over and over (`rounds` times, or endlessly); nothing when there are none."""
    if not sizes:
        return
    passes = itertools.count() if rounds is None else range(rounds)
    for _ in passes:
        yield from sizes


class Planner:
    """Makes request plans for one run: tenants, sizes, exact canary-laced prompts."""

    def __init__(
        self,
        tenants: Sequence[Tenant],
        profile: WorkloadProfile,
        tokenizer: Tokenizer,
        minter: CanaryMinter,
        limits: LimitsLike,
        *,
        api: ApiStyle,
        page_size: int,
        seed: int,
        chat_overhead_tokens: int = 0,
        filler: Filler = "prose",
        first_request: int = 0,
    ) -> None:
        if not tenants:
            raise ConfigError("a workload needs at least one tenant")
        if len({t.name for t in tenants}) != len(tenants):
            raise ConfigError("tenant names must be unique")
        if chat_overhead_tokens < 0:
            raise ConfigError("chat_overhead_tokens cannot be negative")
        self.tenants = tuple(tenants)
        self.profile = profile
        self.workload: ResolvedWorkload = profile.resolve(limits)
        self.tokenizer = tokenizer
        self.minter = minter
        self.index = CanaryIndex(minter, owner_of=self.owner_of)
        """The run's live canaries; a canary that left it is still attributed by `owner_of`."""
        self.api: ApiStyle = api
        self.page_size = page_size
        self.seed = seed
        self.chat_overhead_tokens = chat_overhead_tokens if api == "chat" else 0
        self.filler = filler
        self._limits = limits
        self._rng = random.Random(seed)
        self._weights = [t.weight for t in self.tenants]
        self._next_request = first_request
        self._suffix_counts: dict[str, int] = {}

    def owner_of(self, origin: CanaryOrigin) -> Owner | None:
        """Whose request a decrypted canary was laced into, by the numbering used here."""
        if not 0 <= origin.tenant < len(self.tenants):
            return None
        return Owner(self.tenants[origin.tenant].name, request_id(origin.tenant, origin.request))

    # -- streams the runner draws from ---------------------------------------------------

    def victims(self, phase: str = "fill", *, rounds: int | None = None) -> Iterator[RequestPlan]:
        """Victim plans cycling through the profile's victim sizes (endless by default)."""
        return self._stream(phase, self.workload.victims, rounds)

    def probes(self, phase: str = "probe", *, rounds: int | None = None) -> Iterator[RequestPlan]:
        """Probe plans cycling through the profile's probe sizes (endless by default)."""
        return self._stream(phase, self.workload.probes, rounds)

    def abort_plans(
        self, phase: str = "abort", *, rounds: int | None = None
    ) -> Iterator[RequestPlan]:
        """Plans that drop their connection after `profile.abort_after_chunks` chunks."""
        return self._stream(phase, abort_sizes(self.workload), rounds)

    def _stream(
        self, phase: str, sizes: Sequence[ResolvedSize], rounds: int | None
    ) -> Iterator[RequestPlan]:
        for spec in _cycle(sizes, rounds):
            yield self.plan(phase, spec.intent, spec, self.next_tenant())

    # -- one plan ------------------------------------------------------------------------

    def next_tenant(self) -> int:
        """A tenant index drawn by weight from the seeded generator."""
        return self._rng.choices(range(len(self.tenants)), weights=self._weights)[0]

    def plan(
        self, phase: str, intent: Intent, spec: ResolvedSize | SizeSpec, tenant_index: int
    ) -> RequestPlan:
        """One plan of `spec`'s size for tenant `tenant_index`, numbered next."""
        assert 0 <= tenant_index < len(self.tenants), tenant_index
        if isinstance(spec, SizeSpec):
            spec = spec.resolve(self._limits)
        request = self._next_request
        self._next_request += 1
        prompt, canaries = self._prompt(spec, tenant_index, request)
        return RequestPlan(
            request_id=request_id(tenant_index, request),
            tenant=self.tenants[tenant_index].name,
            phase=phase,
            intent=intent,
            size_label=spec.label,
            num_prompt_tokens=spec.num_tokens,
            expected=spec.expected,
            api=self.api,
            prompt=prompt,
            canaries=canaries,
            max_tokens=max_tokens_for(self.profile, intent),
            disconnect_after_chunks=self.profile.abort_after_chunks if intent == "abort" else None,
            prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest(),
        )

    def _prompt(
        self, spec: ResolvedSize, tenant_index: int, request: int
    ) -> tuple[str, tuple[CanarySpan, ...]]:
        wanted = spec.num_tokens - self.chat_overhead_tokens
        if self.api != "chat":
            built = self._build(spec, tenant_index, request, wanted)
            return built.text, built.canaries
        # joining may merge tokens across the boundary (".\n\n" is one token in cl100k), so
        # the whole is measured; on a miss, other separators and nearby body sizes are tried
        for separator in _SEPARATORS:
            suffix = separator + CHAT_INSTRUCTION
            first_guess = wanted - self._suffix_tokens(suffix)
            for body_tokens in (first_guess + nudge for nudge in _SIZE_NUDGES):
                if body_tokens < 1 and body_tokens != first_guess:
                    continue
                built = self._build(spec, tenant_index, request, body_tokens)
                text = built.text + suffix
                if self.tokenizer.count(text) == wanted:
                    return text, built.canaries
        raise ConfigError(
            f"size {spec.label!r}: cannot fit a chat prompt to exactly {wanted} tokens "
            "in this tokenizer"
        )

    def _suffix_tokens(self, suffix: str) -> int:
        count = self._suffix_counts.get(suffix)
        if count is None:
            count = self._suffix_counts[suffix] = self.tokenizer.count(suffix)
        return count

    def _build(
        self, spec: ResolvedSize, tenant_index: int, request: int, num_tokens: int
    ) -> BuiltPrompt:
        try:
            return build_prompt(
                self.tokenizer,
                self.minter,
                tenant=tenant_index,
                request=request,
                num_tokens=num_tokens,
                page_size=self.page_size,
                filler=self.filler,
                seed=self.seed,  # per-request variety comes from (seed, tenant, request)
            )
        except CanaryError as exc:
            raise ConfigError(
                f"size {spec.label!r} ({spec.num_tokens} tokens) cannot be built as a "
                f"{self.api} prompt: {exc}"
            ) from None

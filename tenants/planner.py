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
from dataclasses import dataclass, field

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
from kvcanary.canaries.prompt import (
    Filler,
    PromptRequest,
    PromptSettings,
    batch_settings,
    build_prompts,
)
from kvcanary.canaries.tokenizer import HuggingFaceTokenizer, TiktokenTokenizer, pieces_add_up
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
QUICK_BUILD_TOKENS = 1 << 15
"""Plans of this many tokens in all, with a local tokenizer, build in a few milliseconds:
short enough to build on the event loop between two reads (`Planner.builds_quickly`)."""
LOCAL_TOKENIZERS = (TiktokenTokenizer, HuggingFaceTokenizer)


LIVE_CANARIES_FLOOR = 1 << 16
"""A run keeps at least this many canaries live (the last few thousand plans' at least)."""
LIVE_KV_MULTIPLE = 4
"""...and those of the latest prompts covering this many times the target's pool and
context (what its KV memory can still hold, with room to spare)."""


def live_canaries(limits: LimitsLike, page_size: int) -> int:
    """How many canaries a run keeps live: enough for the prompts whose pages the target can
    still hold, so that a fragment of any of them is found, but not every canary of a long
    run. An older canary found whole is still attributed through the run key; only its
    fragments go unseen. About 470 bytes each (the text, its k-grams, two dict entries)."""
    tokens = LIVE_KV_MULTIPLE * (limits.pool_tokens + limits.context_tokens)
    # a page holds at most page_size // 2 + 1 canary starts: 2c - 1 <= P
    return max(LIVE_CANARIES_FLOOR, tokens * 2 // max(page_size, 1))


def request_id(tenant_index: int, request: int) -> str:
    return f"t{tenant_index}-r{request:06d}"


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
        max_tokens=profile.max_tokens(spec.intent),
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
        self.index = CanaryIndex(
            minter, owner_of=self.owner_of, keep_live=live_canaries(limits, page_size)
        )
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
        self._settings: PromptSettings | None = None

    def owner_of(self, origin: CanaryOrigin) -> Owner | None:
        """Whose request a decrypted canary was laced into, by the numbering used here."""
        if not 0 <= origin.tenant < len(self.tenants):
            return None
        return Owner(self.tenants[origin.tenant].name, request_id(origin.tenant, origin.request))

    # -- streams the runner draws from ---------------------------------------------------

    def victims(self, phase: str = "fill", *, rounds: int | None = None) -> PlanStream:
        """Victim plans cycling through the profile's victim sizes (endless by default)."""
        return PlanStream(self, phase, self.workload.victims, rounds)

    def probes(self, phase: str = "probe", *, rounds: int | None = None) -> PlanStream:
        """Probe plans cycling through the profile's probe sizes (endless by default)."""
        return PlanStream(self, phase, self.workload.probes, rounds)

    def abort_plans(self, phase: str = "abort", *, rounds: int | None = None) -> PlanStream:
        """Plans that drop their connection after `profile.abort_after_chunks` chunks."""
        return PlanStream(self, phase, abort_sizes(self.workload), rounds)

    # -- plans ---------------------------------------------------------------------------

    def next_tenant(self) -> int:
        """A tenant index drawn by weight from the seeded generator."""
        return self._rng.choices(range(len(self.tenants)), weights=self._weights)[0]

    def plan(
        self, phase: str, intent: Intent, spec: ResolvedSize | SizeSpec, tenant_index: int
    ) -> RequestPlan:
        """One plan of `spec`'s size for tenant `tenant_index`, numbered next."""
        return self.build([self.draw(phase, intent, spec, tenant_index)])[0]

    def draw(
        self, phase: str, intent: Intent, spec: ResolvedSize | SizeSpec, tenant_index: int
    ) -> PlanDraw:
        """The next plan decided, numbered next, not built yet (`build`)."""
        assert 0 <= tenant_index < len(self.tenants), tenant_index
        if isinstance(spec, SizeSpec):
            spec = spec.resolve(self._limits, self.profile.max_tokens(intent))
        request = self._next_request
        self._next_request += 1
        return PlanDraw(phase, intent, spec, tenant_index, request, self)

    def builds_quickly(self, draws: Sequence[PlanDraw]) -> bool:
        """Whether building `draws` is short CPU work in this thread (a local tokenizer, a
        few thousand tokens), not a long build or a tokenizer reached over the network."""
        total = sum(draw.spec.num_tokens for draw in draws)
        return total <= QUICK_BUILD_TOKENS and isinstance(self.tokenizer, LOCAL_TOKENIZERS)

    def build(self, draws: Sequence[PlanDraw]) -> list[RequestPlan]:
        """The plans of `draws` (this planner's), their prompts built in one batch."""
        wanted = [draw.spec.num_tokens - self.chat_overhead_tokens for draw in draws]
        if self.api == "chat":
            suffix = _SEPARATORS[0] + CHAT_INSTRUCTION
            wanted = [n - self._suffix_tokens(suffix) for n in wanted]
        sized = list(zip(draws, wanted, strict=True))
        try:
            requests = [PromptRequest(d.tenant_index, d.request, n) for d, n in sized]
            built = build_prompts(self.tokenizer, self.minter, requests, self._prompt_settings())
        except CanaryError:  # name the size that cannot be built
            built = [self._build(d.spec, d.tenant_index, d.request, n) for d, n in sized]
        return [self._plan(draw, prompt) for draw, prompt in zip(draws, built, strict=True)]

    def sketch(self, draw: PlanDraw) -> RequestPlan:
        """The plan of `draw` but its prompt and canaries: what a run that builds its
        prompts elsewhere (`--ray`: the actors, `harness.run.ray_actor`) draws."""
        return self._planned(draw, "", ())

    @property
    def limits(self) -> LimitsLike:
        """The limits the workload is sized against."""
        return self._limits

    def _plan(self, draw: PlanDraw, built: BuiltPrompt) -> RequestPlan:
        prompt, canaries = built.text, built.canaries
        if self.api == "chat":
            prompt, canaries = self._chat_prompt(draw, built)
        return self._planned(draw, prompt, canaries)

    def _planned(
        self, draw: PlanDraw, prompt: str, canaries: tuple[CanarySpan, ...]
    ) -> RequestPlan:
        spec, intent = draw.spec, draw.intent
        return RequestPlan(
            request_id=request_id(draw.tenant_index, draw.request),
            tenant=self.tenants[draw.tenant_index].name,
            phase=draw.phase,
            intent=intent,
            size_label=spec.label,
            num_prompt_tokens=spec.num_tokens,
            expected=spec.expected,
            api=self.api,
            prompt=prompt,
            canaries=canaries,
            max_tokens=self.profile.max_tokens(intent),
            disconnect_after_chunks=self.profile.abort_after_chunks if intent == "abort" else None,
            prompt_sha256=hashlib.sha256(prompt.encode()).hexdigest() if prompt else "",
        )

    def _chat_prompt(
        self, draw: PlanDraw, first_try: BuiltPrompt
    ) -> tuple[str, tuple[CanarySpan, ...]]:
        """The user message: the laced text, a separator and the instruction, exactly
        `num_tokens` with the template's overhead; `first_try` is the body for the first
        separator at the first guess of its size."""
        spec = draw.spec
        wanted = spec.num_tokens - self.chat_overhead_tokens
        # joining may merge tokens across the boundary (".\n\n" is one token in cl100k), so
        # the junction is measured; on a miss, other separators and nearby body sizes are tried
        for separator in _SEPARATORS:
            suffix = separator + CHAT_INSTRUCTION
            first_guess = wanted - self._suffix_tokens(suffix)
            for body_tokens in (first_guess + nudge for nudge in _SIZE_NUDGES):
                if body_tokens < 1 and body_tokens != first_guess:
                    continue
                if first_try.num_tokens == body_tokens and separator == _SEPARATORS[0]:
                    built = first_try
                else:
                    built = self._build(spec, draw.tenant_index, draw.request, body_tokens)
                if self._fits(built, suffix, wanted):
                    return built.text + suffix, built.canaries
        raise ConfigError(
            f"size {spec.label!r}: cannot fit a chat prompt to exactly {wanted} tokens "
            "in this tokenizer"
        )

    def _fits(self, body: BuiltPrompt, suffix: str, wanted: int) -> bool:
        """Whether body + suffix is `wanted` tokens. Where the pieces of the body add up
        (`pieces_add_up`), only the junction from the body's last canary on is counted: the
        body splits before that canary's space."""
        if pieces_add_up(self.tokenizer) and body.canaries:
            last = body.canaries[-1]
            tail = body.text[last.char_offset - 1 :] + suffix
            return self.tokenizer.count(tail) == wanted - last.token_offset
        return self.tokenizer.count(body.text + suffix) == wanted

    def _prompt_settings(self) -> PromptSettings:
        settings = self._settings
        if settings is None:
            settings = self._settings = batch_settings(
                self.tokenizer,
                self.minter,
                page_size=self.page_size,
                filler=self.filler,
                seed=self.seed,  # per-request variety comes from (seed, tenant, request)
            )
        return settings

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


@dataclass(frozen=True, slots=True)
class PlanDraw:
    """A plan decided but not built yet: its phase, intent and size, the tenant drawn for
    it and its request number. `builder.build` makes it (with others, in one batch)."""

    phase: str
    intent: Intent
    spec: ResolvedSize
    tenant_index: int
    request: int
    builder: Planner = field(repr=False, compare=False)


class PlanStream:
    """One intent's plans, cycling through its sizes (`rounds` times, or endlessly): an
    iterator of built plans, and `draw()` for a caller that builds many at once."""

    def __init__(
        self, planner: Planner, phase: str, sizes: Sequence[ResolvedSize], rounds: int | None
    ) -> None:
        self._planner, self._phase = planner, phase
        self._sizes = _cycle(sizes, rounds)

    def __iter__(self) -> PlanStream:
        return self

    def __next__(self) -> RequestPlan:
        draw = self.draw()
        if draw is None:
            raise StopIteration
        return self._planner.build([draw])[0]

    def draw(self, phase: str | None = None) -> PlanDraw | None:
        """The next plan decided (tenant and number drawn), in `phase` (default: the
        stream's); None when the stream is spent."""
        spec = next(self._sizes, None)
        if spec is None:
            return None
        planner = self._planner
        return planner.draw(phase or self._phase, spec.intent, spec, planner.next_tenant())

"""Prompts of an exact token count, laced with canaries so that any page of them is owned.

Layout (c_i = tokens of canary i with its leading space, P = page size, N = tokens):

- canary 0 starts at token 0, so the prompt's first tokens are unique to the request and
  no legitimate prefix-cache hit between two requests is possible;
- consecutive canaries start at most P + 1 - c_{i+1} tokens apart, i.e. the filler gap
  after canary i is at most P + 1 - c_i - c_{i+1}; with filler "prose" every gap is that
  long, with "none" it is 0;
- the tail after the last canary is at most P - c_last tokens.

Then every window of P consecutive tokens holds a complete canary, and one leaked page
names its owner. That needs 2c - 1 <= P, i.e. c <= (P + 1) / 2; a page size that cannot
be met is a `CanaryError`, never a silently weaker prompt. Short prompts: a prompt of
fewer tokens than one canary is a prefix of the request's canary 0 (the tag and its first
words; N = 1 is the bare tag ` ydk`) and lists no canary spans.

The prompt is built by construction from pieces whose token counts are known (canary
pieces from `canaries.costs`, filler from `canaries.prose`). Every piece starts with a space
and a letter and ends with a letter or punctuation; where the tokenizer's pre-tokenizer
provably splits at every such boundary (`canaries.tokenizer.pieces_add_up`: cl100k_base),
the count is exact by construction and no encode is needed. Any other tokenizer counts the
text once; if it merged tokens across a piece boundary, the first offending boundary is
located by bisection and the filler next to it swapped for another variant of the same
length; if that cannot fix it, `CanaryError`. Every prompt starts with a space (the tag's).

`build_prompts` builds many prompts at once: their canaries are minted in one vectorised
pass and each prompt of one chunk (`_SMALL_CANARIES` canaries at most) is laid out in plain
Python, so a short prompt costs tens of microseconds, not the fixed cost of numpy and the
cipher. Longer prompts are built a chunk at a time (`canaries.prompt_chunks`; counted in a
worker thread where at least `_MIN_CPUS_TO_THREAD` CPUs are usable), so a 1M-token prompt
costs about one pass of the tokenizer. This module knows nothing about detection.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from kvcanary.canaries.costs import CanaryCosts, canary_costs
from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.mint import NUM_INDICES, CanaryMinter
from kvcanary.canaries.prompt_chunks import build_chunked
from kvcanary.canaries.prompt_pieces import canary_prefix, prose_for, repair, too_many
from kvcanary.canaries.prose import NUM_VARIANTS, Prose
from kvcanary.canaries.span import CanarySpan, spans_from_columns
from kvcanary.canaries.tokenizer import Tokenizer, pieces_add_up

Filler = Literal["prose", "none"]
_CHUNK_CANARIES = 16384
"""Canaries minted, laid out and handed to the counting thread at a time (~1/6 of a
1,048,576-token prompt at page size 16); smaller chunks make minting dearer per canary."""
_SMALL_CANARIES = 2048
"""Prompts of at most this many canaries (and of one chunk) are laid out in plain Python:
below it, numpy's fixed cost per call outweighs its speed per canary."""
_MIN_CPUS_TO_THREAD = 4
"""Count in a worker thread only with this many usable CPUs: on the shared 2-core build
machine counting in a thread measured slower than in line (1.4-1.5x one encode against
1.0-1.1x at page size 64; 1.75-1.94x against 1.58-1.68x at 16; benchmarks/RESULTS.md,
issue 18), the thread competing with other processes for the second core."""


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    """A prompt text of exactly `num_tokens` tokens and the canaries laced into it."""

    text: str
    num_tokens: int
    canaries: tuple[CanarySpan, ...]


class PromptRequest(NamedTuple):
    """One prompt to build: whose request it is, and its tokens (overhead included)."""

    tenant: int
    request: int
    num_tokens: int


def build_prompt(
    tokenizer: Tokenizer,
    minter: CanaryMinter,
    *,
    tenant: int,
    request: int,
    num_tokens: int,
    page_size: int = 16,
    filler: Filler = "prose",
    seed: int = 0,
    overhead_tokens: int = 0,
) -> BuiltPrompt:
    """A prompt of `num_tokens - overhead_tokens` tokens in `tokenizer` (the overhead is
    what a chat template adds around it), laced so every `page_size` window holds a canary."""
    wanted = [PromptRequest(tenant, request, num_tokens)]
    settings = PromptSettings.check(tokenizer, minter, page_size, filler, seed)
    return build_prompts(tokenizer, minter, wanted, settings, overhead_tokens=overhead_tokens)[0]


@dataclass(frozen=True, slots=True)
class PromptSettings:
    """What every prompt of a batch shares, checked once."""

    page_size: int
    costs: CanaryCosts
    prose: Prose | None
    seed: int
    stride: int
    """Tokens from one canary's start to the next at most: how many canaries a prompt needs."""
    trusted: bool
    """The tokenizer counts the pieces' sum (`pieces_add_up`): no encode is needed."""

    @classmethod
    def check(
        cls, tokenizer: Tokenizer, minter: CanaryMinter, page_size: int, filler: str, seed: int
    ) -> PromptSettings:
        if filler not in ("prose", "none"):
            raise CanaryError(f"filler must be 'prose' or 'none', got {filler!r}")
        if page_size < 1:
            raise CanaryError(f"page size must be positive, got {page_size}")
        canary_tokens = minter.num_tokens(tokenizer)
        if 2 * canary_tokens - 1 > page_size:
            raise CanaryError(
                f"page size {page_size} cannot hold a complete {canary_tokens}-token canary in "
                f"every window: need c <= (P + 1) / 2, i.e. a page size of at least "
                f"{2 * canary_tokens - 1} (or fewer canary words)"
            )
        costs = canary_costs(tokenizer)
        smallest = costs.tag + minter.num_words * int(costs.words.min())
        stride = smallest if filler == "none" else page_size + 1 - canary_tokens
        prose = prose_for(tokenizer, seed) if filler == "prose" else None
        return cls(page_size, costs, prose, seed, stride, pieces_add_up(tokenizer))


def build_prompts(
    tokenizer: Tokenizer,
    minter: CanaryMinter,
    wanted: Sequence[PromptRequest],
    settings: PromptSettings,
    *,
    overhead_tokens: int = 0,
) -> list[BuiltPrompt]:
    """`build_prompt` for each of `wanted`, in order, with one settings check and one
    minting pass for all the short ones (`batch_settings` makes `settings`)."""
    sizes = []
    for one in wanted:
        n = one.num_tokens - overhead_tokens
        if n < 1:
            raise CanaryError(
                f"{one.num_tokens} tokens leave no room after {overhead_tokens} overhead"
            )
        sizes.append((n, min(n // settings.stride + 2, NUM_INDICES)))
    small = min(_SMALL_CANARIES, _CHUNK_CANARIES)
    short = [i for i, (_, num_minted) in enumerate(sizes) if num_minted <= small]
    built: dict[int, BuiltPrompt] = {}
    if short:
        laid = _Short(tokenizer, minter, settings, [(wanted[i], *sizes[i]) for i in short])
        built.update(zip(short, laid.prompts(), strict=True))
    return [
        built[i] if i in built else _long(tokenizer, minter, settings, one, *sizes[i])
        for i, one in enumerate(wanted)
    ]


def batch_settings(
    tokenizer: Tokenizer, minter: CanaryMinter, *, page_size: int, filler: Filler, seed: int
) -> PromptSettings:
    """The checked settings `build_prompts` takes (a `CanaryError` where they cannot work)."""
    return PromptSettings.check(tokenizer, minter, page_size, filler, seed)


def _variants(
    settings: PromptSettings, one: PromptRequest, num_minted: int
) -> npt.NDArray[np.int64]:
    # the first `num_canaries` draws are those of a draw of exactly that many
    rng = np.random.default_rng([settings.seed, one.tenant, one.request])
    return rng.integers(NUM_VARIANTS, size=num_minted)


def _long(
    tokenizer: Tokenizer,
    minter: CanaryMinter,
    settings: PromptSettings,
    one: PromptRequest,
    n: int,
    num_minted: int,
) -> BuiltPrompt:
    head = minter.mint_digits(one.tenant, one.request, range(1))[0]
    costs = settings.costs
    if n < costs.tag + int(costs.words[head].sum()):
        return BuiltPrompt(canary_prefix(head, n, costs), n, ())
    threaded = num_minted > _CHUNK_CANARIES and _usable_cpus() >= _MIN_CPUS_TO_THREAD
    text, spans = build_chunked(
        tokenizer,
        minter,
        costs,
        origin=(one.tenant, one.request),
        n=n,
        page_size=settings.page_size,
        prose=settings.prose,
        variants=_variants(settings, one, num_minted),
        chunking=(_CHUNK_CANARIES, threaded, settings.trusted),
    )
    return BuiltPrompt(text, n, spans)


class _Short:
    """Prompts of one chunk each, their canaries minted and spelled in one pass, each laid
    out in plain Python (the layout `canaries.prompt_chunks` gives with numpy)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        minter: CanaryMinter,
        settings: PromptSettings,
        wanted: list[tuple[PromptRequest, int, int]],
    ) -> None:
        self._tokenizer, self._settings, self._wanted = tokenizer, settings, wanted
        costs = settings.costs
        self._digits = minter.mint_requests([(w.tenant, w.request, m) for w, _, m in wanted])
        self._lengths: list[int] = (costs.tag + costs.words[self._digits].sum(axis=1)).tolist()
        self._texts = minter.spell(self._digits)
        self._spaced: dict[int, list[str]] = {}

    def prompts(self) -> list[BuiltPrompt]:
        built, first = [], 0
        for one, n, num_minted in self._wanted:
            built.append(self._prompt(one, n, first, num_minted))
            first += num_minted
        return built

    def _prompt(self, one: PromptRequest, n: int, first: int, num_minted: int) -> BuiltPrompt:
        lengths, settings = self._lengths[first : first + num_minted], self._settings
        if n < lengths[0]:
            return BuiltPrompt(canary_prefix(self._digits[first], n, settings.costs), n, ())
        page_size = settings.page_size
        if settings.prose is None:
            starts = _packed_starts(lengths, n, page_size)
            tail = n - starts[-1] - lengths[len(starts) - 1]
            row = self._digits[first + len(starts)]
            tail_text = canary_prefix(row, tail, settings.costs) if tail else ""
            fillers = [" "] * (len(starts) - 1)
        else:
            starts = _prose_starts(lengths, n, page_size)
            variants = _variants(settings, one, num_minted).tolist()
            fillers = self._fillers(starts, lengths, variants)
            tail = n - starts[-1] - lengths[len(starts) - 1]
            tail_text = settings.prose.snippets(tail)[variants[len(starts) - 1]]
        canaries = self._texts[first : first + len(starts)]
        parts = [" " + canaries[0]]
        offsets, width = [1], len(canaries[0])
        for filler, canary in zip(fillers, canaries[1:], strict=True):
            offsets.append(offsets[-1] + width + len(filler))
            parts += (filler, canary)
        parts.append(tail_text)
        text = "".join(parts)
        if not settings.trusted and self._tokenizer.count(text) != n:
            ends = np.add(starts, lengths[: len(starts)])
            gaps = [*(np.array(starts[1:]) - ends[:-1]).tolist(), tail]
            text, fixed = repair(self._tokenizer, parts, ends, gaps, settings.prose, n)
            offsets = fixed.tolist()
        return BuiltPrompt(
            text, n, spans_from_columns(canaries, offsets, starts, range(len(starts)))
        )

    def _fillers(self, starts: list[int], lengths: list[int], variants: list[int]) -> list[str]:
        """The filler before each canary after the first, with that canary's space."""
        prose, spaced = self._settings.prose, self._spaced
        assert prose is not None
        fillers = []
        for j in range(len(starts) - 1):
            gap = starts[j + 1] - starts[j] - lengths[j]
            pool = spaced.get(gap)
            if pool is None:
                pool = spaced[gap] = [snippet + " " for snippet in prose.snippets(gap)]
            fillers.append(pool[variants[j]])
        return fillers


def _prose_starts(lengths: list[int], n: int, page_size: int) -> list[int]:
    """Token starts of a prose-filled prompt's canaries: canary i starts P + 1 - c_i after
    canary i - 1, and the first one that starts in the last page is the last one needed
    (pulled back so that it ends by n)."""
    starts, limit = [0], n - page_size
    for length in lengths[1:]:
        if starts[-1] >= limit:
            break
        starts.append(starts[-1] + page_size + 1 - length)
    if starts[-1] < limit:
        raise too_many(n, page_size)
    num = len(starts)
    starts[-1] = min(starts[-1], n - lengths[num - 1])
    for i in range(num - 1):  # every gap is a filler, every window holds a canary
        assert starts[i] + lengths[i] <= starts[i + 1]
        assert starts[i + 1] + lengths[i + 1] <= starts[i] + page_size + 1
    assert n - starts[-1] - lengths[num - 1] <= page_size - lengths[num - 1]
    return starts


def _packed_starts(lengths: list[int], n: int, page_size: int) -> list[int]:
    """Token starts of canaries back to back (no filler) while they fit in n; one more is
    minted than fit, its prefix fills the tail."""
    starts, end = [], 0
    for length in lengths:
        if end + length > n:
            break
        starts.append(end)
        end += length
    else:  # the last one minted must be left for the tail
        raise too_many(n, page_size)
    assert n - end <= page_size - lengths[len(starts) - 1]
    return starts


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1

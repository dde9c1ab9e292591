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
pieces from `canaries.costs`, filler from `canaries.prose`) and checked once at the end
with a single encode. If a tokenizer merged tokens across a piece boundary, the first
offending boundary is located by bisection and the filler next to it swapped for another
variant of the same length; if that cannot fix it, `CanaryError`. In cl100k_base every
piece starts with a space and ends with a letter or punctuation, so boundaries never merge.
Every prompt starts with a space (the tag's). This module knows nothing about detection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from canaries.costs import CanaryCosts, canary_costs
from canaries.errors import CanaryError
from canaries.mint import NUM_INDICES, CanaryMinter
from canaries.prose import NUM_VARIANTS, Prose
from canaries.shape import TAG, WORDS
from canaries.span import CanarySpan, spans_from_columns
from canaries.tokenizer import Tokenizer

Filler = Literal["prose", "none"]
_MAX_REPAIRS = 32
_PROSE_CACHE_SIZE = 64
_prose_cache: dict[tuple[str, int, int, int], Prose] = {}


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    """A prompt text of exactly `num_tokens` tokens and the canaries laced into it."""

    text: str
    num_tokens: int
    canaries: tuple[CanarySpan, ...]


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
    if filler not in ("prose", "none"):
        raise CanaryError(f"filler must be 'prose' or 'none', got {filler!r}")
    if page_size < 1:
        raise CanaryError(f"page size must be positive, got {page_size}")
    n = num_tokens - overhead_tokens
    if n < 1:
        raise CanaryError(f"{num_tokens} tokens leave no room after {overhead_tokens} overhead")
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
    num_minted = min(n // stride + 2, NUM_INDICES)
    digits = minter.mint_digits(tenant, request, range(num_minted))
    lengths = costs.tag + costs.words[digits].sum(axis=1)
    if n < lengths[0]:
        return BuiltPrompt(_canary_prefix(digits[0], n, costs), n, ())
    starts, num_canaries = _layout(lengths, n, page_size, filler)
    ends = starts + lengths[:num_canaries]
    gaps = starts[1:] - ends[:-1]
    tail = n - int(ends[-1])
    prose = _prose(tokenizer, seed) if filler == "prose" else None
    if prose is not None:
        variants = np.random.default_rng([seed, tenant, request]).integers(
            NUM_VARIANTS, size=num_canaries
        )
        fill, fill_lens = _gap_fillers(prose, gaps, variants[:-1])
        tail_text = prose.snippets(tail)[int(variants[-1])]
    else:
        fill, fill_lens = [" "] * (num_canaries - 1), np.ones(num_canaries - 1, dtype=np.int64)
        tail_text = _canary_prefix(digits[num_canaries], tail, costs) if tail else ""
    canaries = minter.spell(digits[:num_canaries])
    # parts: " " + canary 0, filler 0 + " ", canary 1, ..., canary K-1, tail; the canary
    # strings are shared with the spans, and each filler carries the next canary's space
    parts: list[str] = [""] * (2 * num_canaries)
    parts[0::2] = canaries
    parts[0] = " " + canaries[0]
    parts[1::2] = [*fill, tail_text]
    text = "".join(parts)
    width = len(canaries[0])  # every canary of a minter has the same width
    char_offsets = np.empty(num_canaries, dtype=np.int64)
    char_offsets[0] = 1
    np.cumsum(width + fill_lens, out=char_offsets[1:])
    char_offsets[1:] += 1
    if tokenizer.count(text) != n:
        filler_tokens = [*gaps.tolist(), tail]
        text, char_offsets = _repair(tokenizer, parts, ends, filler_tokens, prose, n)
    spans = spans_from_columns(
        canaries, char_offsets.tolist(), starts.tolist(), range(num_canaries)
    )
    return BuiltPrompt(text, n, spans)


def _layout(
    lengths: npt.NDArray[np.int64], n: int, page_size: int, filler: Filler
) -> tuple[npt.NDArray[np.int64], int]:
    """Token offsets of the canaries that fit, and how many there are."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    if filler == "prose":
        np.cumsum(page_size + 1 - lengths[1:], out=starts[1:])
        # the first canary starting in the last page is the last one needed
        last = int(np.searchsorted(starts, n - page_size, side="left"))
        if last >= len(starts):
            raise _too_many(n, page_size)
        starts[last] = min(starts[last], n - lengths[last])
    else:
        np.cumsum(lengths[:-1], out=starts[1:])
        last = int(np.searchsorted(starts + lengths, n, side="right")) - 1
        if last >= len(starts) - 1:
            raise _too_many(n, page_size)
    num = last + 1
    starts = starts[:num]
    ends = starts + lengths[:num]
    assert starts[0] == 0
    assert (starts[1:] >= ends[:-1]).all()
    assert (starts[1:] + lengths[1:num] <= starts[:-1] + page_size + 1).all()
    assert n - ends[-1] <= page_size - lengths[num - 1]
    return starts, num


def _too_many(n: int, page_size: int) -> CanaryError:
    return CanaryError(
        f"a {n}-token prompt at page size {page_size} needs more than {NUM_INDICES} canaries "
        f"(the index field's limit); use a larger page size or a shorter prompt"
    )


def _prose(tokenizer: Tokenizer, seed: int) -> Prose:
    # by object: a server tokenizer is bound to one event loop, and the cached Prose keeps
    # the tokenizer alive, so its id is not reused while the entry exists
    key = (tokenizer.name, tokenizer.vocab_size, seed, id(tokenizer))
    prose = _prose_cache.get(key)
    if prose is None:
        if len(_prose_cache) >= _PROSE_CACHE_SIZE:
            _prose_cache.pop(next(iter(_prose_cache)))
        prose = _prose_cache[key] = Prose(tokenizer, seed)
    return prose


def _gap_fillers(
    prose: Prose, gaps: npt.NDArray[np.int64], variants: npt.NDArray[np.int64]
) -> tuple[list[str], npt.NDArray[np.int64]]:
    """The filler of every gap, each followed by the next canary's space, and lengths."""
    fill = np.empty(len(gaps), dtype=object)
    lens = np.empty(len(gaps), dtype=np.int64)
    for gap in np.unique(gaps).tolist():
        pool = [snippet + " " for snippet in prose.snippets(gap)]
        chosen = gaps == gap
        fill[chosen] = np.array(pool, dtype=object)[variants[chosen]]
        lens[chosen] = np.array([len(s) for s in pool], dtype=np.int64)[variants[chosen]]
    return fill.tolist(), lens


def _canary_prefix(digits: npt.NDArray[np.int64], num_tokens: int, costs: CanaryCosts) -> str:
    """The first `num_tokens` tokens of a canary: the tag, then whole words while they fit,
    then one-token words if a multi-token word would overshoot."""
    pieces, remaining = [" " + TAG], num_tokens - costs.tag
    if remaining < 0:
        raise CanaryError(f"a {num_tokens}-token prompt is shorter than the canary tag")
    one_token = [i for i in np.flatnonzero(costs.words == 1)[:8].tolist()]
    for digit in digits.tolist() * 2:
        if remaining == 0:
            break
        cost = int(costs.words[digit])
        if cost > remaining:
            if not one_token:
                raise CanaryError("no one-token canary word to pad a short prompt with")
            digit, cost = one_token[digit % len(one_token)], 1
        pieces.append(" " + WORDS[digit])
        remaining -= cost
    assert remaining == 0
    return "".join(pieces)


def _repair(
    tokenizer: Tokenizer,
    parts: list[str],
    canary_ends: npt.NDArray[np.int64],
    filler_tokens: list[int],
    prose: Prose | None,
    n: int,
) -> tuple[str, npt.NDArray[np.int64]]:
    """Swaps filler variants before merged canaries until the count is exact.

    Parts alternate canary and filler (plus the next canary's space); canary i should end
    at token canary_ends[i], filler j should hold filler_tokens[j] tokens. Returns the text
    and the canaries' character offsets."""
    for _ in range(_MAX_REPAIRS):
        lens = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        part_starts = np.cumsum(lens) - lens
        char_offsets = part_starts[0::2].copy()
        char_offsets[0] += 1  # parts[0] holds canary 0's space; later ones, the filler
        text = "".join(parts)
        if tokenizer.count(text) == n:
            return text, char_offsets
        ends = part_starts[0::2] + lens[0::2]
        ok, bad = -1, len(canary_ends)  # prefixes through canary `ok` count right
        while bad - ok > 1:
            mid = (ok + bad) // 2
            if tokenizer.count(text[: ends[mid]]) == canary_ends[mid]:
                ok = mid
            else:
                bad = mid
        # canary `bad` merged with the filler before it, or (bad = K) the tail with its canary
        filler = bad - 1 if bad < len(canary_ends) else len(filler_tokens) - 1
        if prose is None or filler < 0 or filler_tokens[filler] == 0:
            break
        part = parts[2 * filler + 1]
        snippet = part.removesuffix(" ") if filler < len(filler_tokens) - 1 else part
        pool = prose.snippets(filler_tokens[filler])
        swapped = pool[(pool.index(snippet) + 1) % len(pool)]
        parts[2 * filler + 1] = swapped + part[len(snippet) :]
    raise CanaryError(
        f"tokenizer {tokenizer.name} merges tokens across canary boundaries; "
        f"cannot build an exact {n}-token prompt"
    )

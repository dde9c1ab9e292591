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
_prose_cache: dict[tuple[str, int, int], Prose] = {}


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
    if filler == "prose":
        prose = _prose(tokenizer, seed)
        variants = np.random.default_rng([seed, tenant, request]).integers(
            NUM_VARIANTS, size=num_canaries
        )
        fill = _gap_fillers(prose, gaps, variants)
        tail_text = prose.snippets(tail)[int(variants[-1])]
    else:
        prose = None
        fill = [""] * (num_canaries - 1)
        tail_text = _canary_prefix(digits[num_canaries], tail, costs) if tail else ""
    canaries = minter.spell(digits[:num_canaries])
    parts: list[str] = [""] * (2 * num_canaries)
    parts[0::2] = [" " + canary for canary in canaries]
    parts[1::2] = [*fill, tail_text]
    text = "".join(parts)
    if tokenizer.count(text) != n:
        part_tokens = np.empty(2 * num_canaries, dtype=np.int64)
        part_tokens[0::2] = lengths[:num_canaries]
        part_tokens[1::2] = [*gaps.tolist(), tail]
        text = _repair(tokenizer, parts, part_tokens, prose, n)
    lens = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    char_offsets = (np.cumsum(lens) - lens)[0::2] + 1  # + 1: past the leading space
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
    key = (tokenizer.name, tokenizer.vocab_size, seed)
    prose = _prose_cache.get(key)
    if prose is None:
        if len(_prose_cache) >= _PROSE_CACHE_SIZE:
            _prose_cache.pop(next(iter(_prose_cache)))
        prose = _prose_cache[key] = Prose(tokenizer, seed)
    return prose


def _gap_fillers(
    prose: Prose, gaps: npt.NDArray[np.int64], variants: npt.NDArray[np.int64]
) -> list[str]:
    fill = np.empty(len(gaps), dtype=object)
    for gap in np.unique(gaps).tolist():
        chosen = gaps == gap
        fill[chosen] = np.array(prose.snippets(gap), dtype=object)[variants[:-1][chosen]]
    return fill.tolist()


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
    part_tokens: npt.NDArray[np.int64],
    prose: Prose | None,
    n: int,
) -> str:
    """Swaps filler variants next to merged boundaries until the count is exact."""
    expected = np.concatenate([[0], np.cumsum(part_tokens)])
    for _ in range(_MAX_REPAIRS):
        text = "".join(parts)
        if tokenizer.count(text) == n:
            return text
        lens = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        ends = np.concatenate([[0], np.cumsum(lens)])
        ok, bad = 0, len(parts)  # prefixes of `ok` parts count right, of `bad` parts not
        while bad - ok > 1:
            mid = (ok + bad) // 2
            if tokenizer.count(text[: ends[mid]]) == expected[mid]:
                ok = mid
            else:
                bad = mid
        # part bad-1 merged with its left neighbour; fillers sit at odd positions
        filler_at = next((i for i in (bad - 1, bad - 2) if i % 2 == 1 and i >= 0), None)
        if prose is None or filler_at is None or part_tokens[filler_at] == 0:
            break
        pool = prose.snippets(int(part_tokens[filler_at]))
        parts[filler_at] = pool[(pool.index(parts[filler_at]) + 1) % len(pool)]
    raise CanaryError(
        f"tokenizer {tokenizer.name} merges tokens across canary boundaries; "
        f"cannot build an exact {n}-token prompt"
    )

"""The pieces both prompt builders (`canaries.prompt` for prompts of one chunk,
`canaries.prompt_chunks` for long ones) share: the filler of one tokenizer and seed, the
prefix of a canary that fills a prompt too short for a whole one, the repair of a merged
boundary, and the error for a prompt that needs more canaries than the index field holds.

Parts alternate canary and filler: " " + canary 0, filler 0 + " ", canary 1, ..., the tail;
each filler carries the next canary's space. This module knows nothing about layout.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvcanary.canaries.costs import PAD_WORD, CanaryCosts
from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.mint import NUM_INDICES
from kvcanary.canaries.prose import Prose
from kvcanary.canaries.shape import TAG, WORDS
from kvcanary.canaries.tokenizer import Tokenizer

MAX_REPAIRS = 32
_PROSE_CACHE_SIZE = 64
_prose_cache: dict[tuple[str, int, int, int], Prose] = {}


def prose_for(tokenizer: Tokenizer, seed: int) -> Prose:
    """The filler of `tokenizer` and `seed`, built once (its pools fill as sizes are used)."""
    # by object: a server tokenizer is bound to one event loop, and the cached Prose keeps
    # the tokenizer alive, so its id is not reused while the entry exists
    key = (tokenizer.name, tokenizer.vocab_size, seed, id(tokenizer))
    prose = _prose_cache.get(key)
    if prose is None:
        if len(_prose_cache) >= _PROSE_CACHE_SIZE:
            _prose_cache.pop(next(iter(_prose_cache)))
        prose = _prose_cache[key] = Prose(tokenizer, seed)
    return prose


def too_many(n: int, page_size: int) -> CanaryError:
    return CanaryError(
        f"a {n}-token prompt at page size {page_size} needs more than {NUM_INDICES} canaries "
        f"(the index field's limit); use a larger page size or a shorter prompt"
    )


def canary_prefix(digits: npt.NDArray[np.int64], num_tokens: int, costs: CanaryCosts) -> str:
    """The first `num_tokens` tokens of a canary: the tag, then whole words while they fit,
    then one-token words if a multi-token word would overshoot."""
    pieces, remaining = [" " + TAG], num_tokens - costs.tag
    if remaining < 0:  # the tag takes several tokens here: a prefix of the tag, if one fits
        fits = [i for i, cost in enumerate(costs.tag_prefixes) if cost == num_tokens]
        if fits:
            return " " + TAG[: fits[-1]]
        raise CanaryError(f"a {num_tokens}-token prompt is shorter than the canary tag")
    one_token = [i for i in np.flatnonzero(costs.words == 1)[:8].tolist()]
    for digit in digits.tolist() * 2:
        if remaining == 0:
            break
        cost = int(costs.words[digit])
        if cost > remaining and not one_token:  # the rest is a prefix of one pad word
            fits = [i for i, c in enumerate(costs.pad_prefixes) if c == remaining]
            if not fits:
                raise CanaryError("no canary word piece to pad a short prompt with")
            pieces.append(" " + PAD_WORD[: fits[-1]])
            remaining = 0
            break
        if cost > remaining:
            digit, cost = one_token[digit % len(one_token)], 1
        pieces.append(" " + WORDS[digit])
        remaining -= cost
    assert remaining == 0
    return "".join(pieces)


def repair(
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
    for _ in range(MAX_REPAIRS):
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

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
pieces from `canaries.costs`, filler from `canaries.prose`) and checked with one pass of
the tokenizer over its text. Canaries are minted and laid out a chunk at a time, and each
chunk's segment of text is counted (where at least `_MIN_CPUS_TO_THREAD` CPUs are usable,
in one worker thread while the next is minted, for tokenizers that release the GIL), so a
1M-token prompt costs little more than that pass; a short window across each cut between
segments is counted too, so a merge at a cut is seen. If a tokenizer merged tokens across a
piece boundary, the first offending boundary is located by bisection and the filler next to
it swapped for another variant of the same length; if that cannot fix it, `CanaryError`. In
cl100k_base every piece starts with a space and ends with a letter or punctuation, so
boundaries never merge. Every prompt starts with a space (the tag's). This module knows
nothing about detection.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvcanary.canaries.costs import PAD_WORD, CanaryCosts, canary_costs
from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.mint import NUM_INDICES, CanaryMinter
from kvcanary.canaries.prose import NUM_VARIANTS, Prose
from kvcanary.canaries.shape import TAG, WORDS
from kvcanary.canaries.span import CanarySpan, spans_from_columns
from kvcanary.canaries.tokenizer import HuggingFaceTokenizer, TiktokenTokenizer, Tokenizer

Filler = Literal["prose", "none"]
_MAX_REPAIRS = 32
_CHUNK_CANARIES = 16384
"""Canaries minted, laid out and handed to the counting thread at a time (~1/6 of a
1,048,576-token prompt at page size 16); smaller chunks make minting dearer per canary."""
_MIN_CPUS_TO_THREAD = 4
"""Count in a worker thread only with this many usable CPUs: on the shared 2-core build
machine counting in a thread measured slower than in line (1.4-1.5x one encode against
1.0-1.1x at page size 64; 1.75-1.94x against 1.58-1.68x at 16; benchmarks/RESULTS.md,
issue 18), the thread competing with other processes for the second core."""
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
    mint = functools.partial(minter.mint_digits, tenant, request)
    head = mint(range(1))
    if n < costs.tag + int(costs.words[head[0]].sum()):
        return BuiltPrompt(_canary_prefix(head[0], n, costs), n, ())
    prose = _prose(tokenizer, seed) if filler == "prose" else None
    # the first `num_canaries` draws are those of a draw of exactly that many
    variants = np.random.default_rng([seed, tenant, request]).integers(
        NUM_VARIANTS, size=num_minted
    )
    builder = _Builder(tokenizer, minter, prose, variants)
    threaded = num_minted > _CHUNK_CANARIES and _usable_cpus() >= _MIN_CPUS_TO_THREAD
    with _Counter(tokenizer, threaded) as counter:
        if prose is not None:
            chunks = _prose_chunks(mint, costs, n, page_size, num_minted)
        else:
            digits = mint(range(num_minted))
            lengths = costs.tag + costs.words[digits].sum(axis=1)
            starts, num = _layout(lengths, n, page_size, filler)
            chunks = iter([(digits[:num], starts, lengths[:num])])
            tail = n - int(starts[-1] + lengths[num - 1])
            builder.tail_text = _canary_prefix(digits[num], tail, costs) if tail else ""
        segments: list[str] = []
        for chunk in chunks:
            segments.append(counter.submit(*builder.add(*chunk)))
        segments.append(counter.submit(*builder.finish(n)))
        for window, expected in builder.boundaries():
            counter.submit(window, expected)
        spans = spans_from_columns(
            builder.canaries, builder.char_offsets(), builder.starts().tolist(), range(builder.num)
        )
        exact = counter.all_exact()
    text = "".join(segments)  # a copy of a few long strings, not of every part again
    del segments
    if not exact:
        ends = builder.starts() + builder.lengths()
        filler_tokens = [*(builder.starts()[1:] - ends[:-1]).tolist(), builder.tail]
        text, char_offsets = _repair(tokenizer, builder.parts, ends, filler_tokens, prose, n)
        spans = spans_from_columns(
            builder.canaries, char_offsets.tolist(), builder.starts().tolist(), range(builder.num)
        )
    return BuiltPrompt(text, n, spans)


Chunk = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]
"""Word digits, token starts and token lengths of consecutive canaries."""


def _prose_chunks(
    mint: Callable[[range], npt.NDArray[np.int64]],
    costs: CanaryCosts,
    n: int,
    page_size: int,
    num_minted: int,
) -> Iterator[Chunk]:
    """The canaries of a prose-filled prompt, minted and laid out `_CHUNK_CANARIES` at a
    time, so the first segments are being counted while the later ones are minted.

    Canary i starts at the sum of P + 1 - c_j over j in 1..i; the first one that starts in
    the last page is the last one needed (the same layout as `_layout`)."""
    base, prev_end = 0, 0
    for lo in range(0, num_minted, _CHUNK_CANARIES):
        digits = mint(range(lo, min(lo + _CHUNK_CANARIES, num_minted)))
        lengths = costs.tag + costs.words[digits].sum(axis=1)
        steps = page_size + 1 - lengths
        if lo == 0:
            steps[0] = 0
        starts = base + np.cumsum(steps)
        last = int(np.searchsorted(starts, n - page_size, side="left"))
        done = last < len(starts)
        if done:
            digits, starts, lengths = digits[: last + 1], starts[: last + 1], lengths[: last + 1]
            starts[-1] = min(starts[-1], n - lengths[-1])
        ends = starts + lengths
        assert starts[0] >= prev_end
        assert (starts[1:] >= ends[:-1]).all()
        assert lo == 0 or ends[0] <= base + page_size + 1
        assert (ends[1:] <= starts[:-1] + page_size + 1).all()
        if done:
            assert n - ends[-1] <= page_size - lengths[-1]
        yield digits, starts, lengths
        if done:
            return
        base, prev_end = int(starts[-1]), int(ends[-1])
    raise _too_many(n, page_size)


class _Builder:
    """The prompt's parts, built chunk by chunk, and each chunk's segment of text with the
    tokens it must count to.

    Parts alternate canary and filler: " " + canary 0, filler 0 + " ", canary 1, ..., the
    tail; the canary strings are shared with the spans, and each filler carries the next
    canary's space. A segment ends after a canary (the next one starts with a filler's
    space), so a tokenizer that splits before spaces counts segments additively."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        minter: CanaryMinter,
        prose: Prose | None,
        variants: npt.NDArray[np.int64],
    ) -> None:
        self._tokenizer, self._minter, self._prose = tokenizer, minter, prose
        self._variants = variants
        self.parts: list[str] = []
        self.canaries: list[str] = []
        self._offsets: list[npt.NDArray[np.int64]] = []
        self._starts: list[npt.NDArray[np.int64]] = []
        self._lengths: list[npt.NDArray[np.int64]] = []
        self._cuts: list[int] = []
        """Canary numbers that begin a segment after the first."""
        self._num_chars = 0
        self._end = 0
        self.num = 0
        self.tail = 0
        self.tail_text = ""

    def add(
        self,
        digits: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
    ) -> tuple[str, int]:
        """The chunk's parts; returns its segment (the filler before it included) and the
        tokens the segment holds."""
        canaries = self._minter.spell(digits)
        first, num = self.num, len(canaries)
        ends = starts + lengths
        # fill[j]: what precedes canary first + j (a filler and the canary's space)
        if first == 0:
            fill, fill_lens = self._fillers(starts[1:] - ends[:-1], self._variants[: num - 1])
            fill, fill_lens = [" ", *fill], np.concatenate([[1], fill_lens])
        else:
            gaps = np.concatenate([[starts[0] - self._end], starts[1:] - ends[:-1]])
            fill, fill_lens = self._fillers(gaps, self._variants[first - 1 : first + num - 1])
            self._cuts.append(first)
        parts: list[str] = [""] * (2 * num)
        parts[0::2] = fill
        parts[1::2] = canaries
        segment = "".join(parts)
        if first == 0:
            parts[:2] = [" " + canaries[0]]
        width = len(canaries[0])  # every canary of a minter has the same width
        self._offsets.append(
            self._num_chars + np.cumsum(fill_lens) + np.arange(num, dtype=np.int64) * width
        )
        self.parts += parts
        self.canaries += canaries
        self._starts.append(starts)
        self._lengths.append(lengths)
        num_tokens = int(ends[-1]) - self._end
        self._num_chars += len(segment)
        self._end, self.num = int(ends[-1]), first + num
        return segment, num_tokens

    def _fillers(
        self, gaps: npt.NDArray[np.int64], variants: npt.NDArray[np.int64]
    ) -> tuple[list[str], npt.NDArray[np.int64]]:
        if self._prose is not None:
            return _gap_fillers(self._prose, gaps, variants)
        assert not gaps.any()  # without filler, canaries follow each other
        return [" "] * len(gaps), np.ones(len(gaps), dtype=np.int64)

    def finish(self, n: int) -> tuple[str, int]:
        """The tail after the last canary, as a segment of its own."""
        self.tail = n - self._end
        if self._prose is not None:
            self.tail_text = self._prose.snippets(self.tail)[int(self._variants[self.num - 1])]
        self.parts.append(self.tail_text)
        return self.tail_text, self.tail

    def boundaries(self) -> Iterator[tuple[str, int]]:
        """A window around each cut between segments, and the tokens it must count to:
        a tokenizer that merged across a cut miscounts its window."""
        starts, lengths = self.starts(), self.lengths()
        for cut in [*self._cuts, self.num]:
            before = " " + self.canaries[cut - 1]
            end = int(starts[cut - 1] + lengths[cut - 1])
            if cut < self.num:
                after = self.parts[2 * cut - 1] + self.canaries[cut]
                num_tokens = int(starts[cut] + lengths[cut]) - end
            else:
                after, num_tokens = self.tail_text, self.tail
            yield before + after, int(lengths[cut - 1]) + num_tokens

    def char_offsets(self) -> list[int]:
        return np.concatenate(self._offsets).tolist()  # type: ignore[no-any-return]

    def starts(self) -> npt.NDArray[np.int64]:
        return np.concatenate(self._starts)

    def lengths(self) -> npt.NDArray[np.int64]:
        return np.concatenate(self._lengths)


class _Counter:
    """Counts segments against what they must hold, in order, in one worker thread where the
    tokenizer releases the GIL (tiktoken, Hugging Face), so counting overlaps building."""

    def __init__(self, tokenizer: Tokenizer, threaded: bool) -> None:
        self._count = tokenizer.count
        threaded = threaded and isinstance(tokenizer, TiktokenTokenizer | HuggingFaceTokenizer)
        self._pool = ThreadPoolExecutor(1, "kvcanary-count") if threaded else None
        self._checks: list[Future[bool] | bool] = []

    def __enter__(self) -> _Counter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, text: str, num_tokens: int) -> str:
        """Check that `text` holds `num_tokens` tokens (now, or soon in the thread)."""
        if self._pool is None:
            self._checks.append(self._count(text) == num_tokens)
        else:
            self._checks.append(self._pool.submit(self._exact, text, num_tokens))
        return text

    def _exact(self, text: str, num_tokens: int) -> bool:
        return self._count(text) == num_tokens

    def all_exact(self) -> bool:
        return all(c if isinstance(c, bool) else c.result() for c in self._checks)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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

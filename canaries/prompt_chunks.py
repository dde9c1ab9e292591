"""Long laced prompts, built a chunk of canaries at a time (`canaries.prompt` lays out a
prompt of one chunk in plain Python, and hands longer ones here).

Canaries are minted and laid out `chunk_canaries` at a time with numpy, and each chunk's
segment of text is counted (where the caller says so, in one worker thread while the next
is minted, for tokenizers that release the GIL), so a 1M-token prompt costs little more
than one pass of the tokenizer; a short window across each cut between segments is counted
too, so a merge at a cut is seen. A tokenizer whose pieces provably add up (`trusted`,
`canaries.tokenizer.pieces_add_up`) is not asked at all. The layout is `canaries.prompt`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from kvcanary.canaries.costs import CanaryCosts
from kvcanary.canaries.mint import CanaryMinter
from kvcanary.canaries.prompt_pieces import canary_prefix, repair, too_many
from kvcanary.canaries.prose import Prose
from kvcanary.canaries.span import CanarySpan, spans_from_columns
from kvcanary.canaries.tokenizer import HuggingFaceTokenizer, TiktokenTokenizer, Tokenizer

Chunk = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]
"""Word digits, token starts and token lengths of consecutive canaries."""


def build_chunked(
    tokenizer: Tokenizer,
    minter: CanaryMinter,
    costs: CanaryCosts,
    *,
    origin: tuple[int, int],
    n: int,
    page_size: int,
    prose: Prose | None,
    variants: npt.NDArray[np.int64],
    chunking: tuple[int, bool, bool],
) -> tuple[str, tuple[CanarySpan, ...]]:
    """The text and spans of an `n`-token prompt of the request `origin` (tenant, request);
    `chunking` is (canaries per chunk, count in a thread, trust the pieces' costs)."""
    chunk_canaries, threaded, trusted = chunking
    mint = functools.partial(minter.mint_digits, *origin)
    num_minted = len(variants)
    builder = _Builder(minter, prose, variants)
    with _Counter(tokenizer, threaded, trusted) as counter:
        if prose is not None:
            chunks = _prose_chunks(mint, costs, (n, page_size, num_minted, chunk_canaries))
        else:
            digits = mint(range(num_minted))
            lengths = costs.tag + costs.words[digits].sum(axis=1)
            starts, num = _packed_layout(lengths, n, page_size)
            chunks = iter([(digits[:num], starts, lengths[:num])])
            tail = n - int(starts[-1] + lengths[num - 1])
            builder.tail_text = canary_prefix(digits[num], tail, costs) if tail else ""
        segments = [counter.submit(*builder.add(*chunk)) for chunk in chunks]
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
        text, char_offsets = repair(tokenizer, builder.parts, ends, filler_tokens, prose, n)
        spans = spans_from_columns(
            builder.canaries, char_offsets.tolist(), builder.starts().tolist(), range(builder.num)
        )
    return text, spans


def _prose_chunks(
    mint: Callable[[range], npt.NDArray[np.int64]],
    costs: CanaryCosts,
    sizes: tuple[int, int, int, int],
) -> Iterator[Chunk]:
    """The canaries of a prose-filled prompt, minted and laid out a chunk at a time, so
    the first segments are being counted while the later ones are minted; `sizes` is
    (tokens, page size, canaries minted, canaries per chunk).

    Canary i starts at the sum of P + 1 - c_j over j in 1..i; the first one that starts in
    the last page is the last one needed (`canaries.prompt.prose_starts`)."""
    n, page_size, num_minted, chunk_canaries = sizes
    base, prev_end = 0, 0
    for lo in range(0, num_minted, chunk_canaries):
        digits = mint(range(lo, min(lo + chunk_canaries, num_minted)))
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
    raise too_many(n, page_size)


def _packed_layout(
    lengths: npt.NDArray[np.int64], n: int, page_size: int
) -> tuple[npt.NDArray[np.int64], int]:
    """Token offsets of the canaries that fit back to back (no filler), and how many."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    last = int(np.searchsorted(starts + lengths, n, side="right")) - 1
    if last >= len(starts) - 1:
        raise too_many(n, page_size)
    num = last + 1
    starts = starts[:num]
    ends = starts + lengths[:num]
    assert starts[0] == 0
    assert (starts[1:] >= ends[:-1]).all()
    assert (starts[1:] + lengths[1:num] <= starts[:-1] + page_size + 1).all()
    assert n - ends[-1] <= page_size - lengths[num - 1]
    return starts, num


class _Builder:
    """The prompt's parts, built chunk by chunk, and each chunk's segment of text with the
    tokens it must count to.

    Parts alternate canary and filler: " " + canary 0, filler 0 + " ", canary 1, ..., the
    tail; the canary strings are shared with the spans, and each filler carries the next
    canary's space. A segment ends after a canary (the next one starts with a filler's
    space), so a tokenizer that splits before spaces counts segments additively."""

    def __init__(
        self, minter: CanaryMinter, prose: Prose | None, variants: npt.NDArray[np.int64]
    ) -> None:
        self._minter, self._prose = minter, prose
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
    tokenizer releases the GIL (tiktoken, Hugging Face), so counting overlaps building; a
    `trusted` tokenizer's pieces add up (`canaries.tokenizer.pieces_add_up`): not counted."""

    def __init__(self, tokenizer: Tokenizer, threaded: bool, trusted: bool) -> None:
        self._count = tokenizer.count
        self._trusted = trusted
        threaded = threaded and isinstance(tokenizer, TiktokenTokenizer | HuggingFaceTokenizer)
        self._pool = ThreadPoolExecutor(1, "kvcanary-count") if threaded and not trusted else None
        self._checks: list[Future[bool] | bool] = []

    def __enter__(self) -> _Counter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, text: str, num_tokens: int) -> str:
        """Check that `text` holds `num_tokens` tokens (now, or soon in the thread)."""
        if self._trusted:
            pass
        elif self._pool is None:
            self._checks.append(self._count(text) == num_tokens)
        else:
            self._checks.append(self._pool.submit(self._exact, text, num_tokens))
        return text

    def _exact(self, text: str, num_tokens: int) -> bool:
        return self._count(text) == num_tokens

    def all_exact(self) -> bool:
        return all(c if isinstance(c, bool) else c.result() for c in self._checks)


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

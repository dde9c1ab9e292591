"""The prompt's compiled helpers (canaries._columns) and its counting give what the
pure-Python steps give, and the package works the same without them."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canaries import CanaryMinter, Tokenizer, build_prompt, mint, span
from kvcanary.canaries.shape import WORDS
from kvcanary.canaries.span import CanarySpan, spans_from_columns

COMPILED_SPELL = mint._load_spell()
COMPILED_SPANS = span._load_core()
needs_core = pytest.mark.skipif(
    COMPILED_SPELL is None or COMPILED_SPANS is None,
    reason="canaries._columns was not built (no C compiler at install)",
)


def python_spell(digits: np.ndarray) -> list[str]:
    saved, mint._SPELL = mint._SPELL, None
    try:
        return CanaryMinter.spell(digits)
    finally:
        mint._SPELL = saved


@needs_core
@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.integers(0, len(WORDS) - 1), min_size=6, max_size=6),
        min_size=1,
        max_size=30,
    )
)
def test_the_compiled_spelling_is_the_numpy_one(rows: list[list[int]]) -> None:
    digits = np.array(rows, dtype=np.int64).reshape(len(rows), 6)
    assert CanaryMinter.spell(digits) == python_spell(digits)
    strided = np.repeat(digits, 2, axis=1)[:, ::2]  # not contiguous: spell copies it
    assert CanaryMinter.spell(strided) == python_spell(strided)


@needs_core
def test_the_compiled_spelling_refuses_bad_digits_and_bytes() -> None:
    assert COMPILED_SPELL is not None
    table = b" abcdef ghijkl"
    assert COMPILED_SPELL(np.array([[1, 0]]), table, 7, b"ydk") == ["ydk ghijkl abcdef"]
    with pytest.raises(IndexError, match="outside"):
        COMPILED_SPELL(np.array([[2, 0]]), table, 7, b"ydk")
    with pytest.raises(IndexError, match="outside"):
        COMPILED_SPELL(np.array([[-1, 0]]), table, 7, b"ydk")
    with pytest.raises(ValueError, match="non-ASCII"):
        COMPILED_SPELL(np.array([[0]]), b" abcde\xff", 7, b"ydk")
    with pytest.raises(ValueError, match="divide"):
        COMPILED_SPELL(np.array([[0]]), table, 6, b"ydk")
    with pytest.raises(TypeError, match="int64"):
        COMPILED_SPELL(np.array([[0]], dtype=np.int32), table, 7, b"ydk")
    with pytest.raises(TypeError, match="int64"):
        COMPILED_SPELL(np.array([0]), table, 7, b"ydk")


def python_spans(*columns: list[object]) -> tuple[CanarySpan, ...]:
    saved, span.CORE = span.CORE, None
    try:
        return spans_from_columns(*columns)  # type: ignore[arg-type]
    finally:
        span.CORE = saved


@needs_core
@settings(max_examples=50, deadline=None)
@given(rows=st.lists(st.tuples(st.text(max_size=5), st.integers(), st.integers()), max_size=30))
def test_compiled_spans_equal_dataclass_spans(rows: list[tuple[str, int, int]]) -> None:
    texts = [r[0] for r in rows]
    chars, tokens = [r[1] for r in rows], tuple(r[2] for r in rows)
    got = spans_from_columns(texts, chars, tokens, range(len(rows)))
    assert type(got) is tuple
    assert got == tuple(CanarySpan(*r, i) for i, r in enumerate(rows))
    assert got == python_spans(texts, chars, list(tokens), list(range(len(rows))))
    assert not any(map(gc.is_tracked, got))  # str and ints: no cycle possible


@needs_core
def test_compiled_spans_of_other_values_stay_tracked_and_bad_columns_are_refused() -> None:
    assert COMPILED_SPANS is not None
    fields = ("text", "char_offset", "token_offset", "index")
    held = [[]]  # a list can be part of a cycle: the span must stay tracked
    (tracked,) = COMPILED_SPANS(CanarySpan, fields, ["a"], held, [1], [2])
    assert gc.is_tracked(tracked)
    assert tracked.char_offset is held[0]
    with pytest.raises(ValueError, match="different lengths"):
        COMPILED_SPANS(CanarySpan, fields, ["a"], [1, 2], [1], [2])
    with pytest.raises(TypeError, match="list or a tuple"):
        COMPILED_SPANS(CanarySpan, fields, ["a"], iter([1]), [1], [2])
    with pytest.raises(TypeError, match="not a slot"):
        COMPILED_SPANS(CanarySpan, ("text", "__init__", "token_offset", "index"), [], [], [], [])
    with pytest.raises(ValueError, match="one column each"):
        COMPILED_SPANS(CanarySpan, fields, ["a"])


def test_a_prompt_is_the_same_without_the_compiled_helpers(
    cl100k: Tokenizer, minter: CanaryMinter
) -> None:
    def build() -> object:
        return build_prompt(cl100k, minter, tenant=2, request=3, num_tokens=40_000)

    compiled = build()
    saved = (mint._SPELL, span.CORE, getattr(cl100k, "_buffer", None))
    mint._SPELL, span.CORE = None, None
    if hasattr(cl100k, "_buffer"):
        cl100k._buffer = None  # count the list of token ids instead
    try:
        assert build() == compiled
    finally:
        mint._SPELL, span.CORE = saved[0], saved[1]
        if hasattr(cl100k, "_buffer"):
            cl100k._buffer = saved[2]


@settings(max_examples=100, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=60),
        st.lists(
            st.sampled_from(["<|endoftext|>", "<|fim_prefix|>", " ydk", "\ud800", "  ", "é"]),
            max_size=12,
        ).map("".join),
    )
)
def test_counting_is_the_length_of_the_encoding(cl100k: Tokenizer, text: str) -> None:
    assert cl100k.count(text) == len(cl100k.encode(text))


def test_minting_a_range_is_minting_its_list(minter: CanaryMinter) -> None:
    for indices in (range(5, 40, 3), range(30, 2, -4), range(7, 8)):
        assert (minter.mint_digits(1, 2, indices) == minter.mint_digits(1, 2, list(indices))).all()
    assert minter.mint_digits(1, 2, range(0)).shape == (0, minter.num_words)
    for outside in (range(-1, 3), range(2**18 - 2, 2**18 + 1), range(2**18, 0, -1)):
        with pytest.raises(Exception, match="canary index outside"):
            minter.mint_digits(1, 2, outside)


def test_without_the_built_module_the_loaders_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        sys.modules, "kvcanary.canaries._columns", None
    )  # import now raises ImportError
    assert mint._load_spell() is None
    assert span._load_core() is None

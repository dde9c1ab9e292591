"""The prompt's compiled helpers (canaries._columns: canary texts, and spans and hits made
through their classes' public protocols) and its counting give what the pure-Python steps
give, and the package works the same without them."""

from __future__ import annotations

import dataclasses
import gc
import sys
from itertools import repeat
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canaries import CanaryMinter, Hit, Owner, Tokenizer, build_prompt, mint, records
from kvcanary.canaries.mint import CanaryOrigin
from kvcanary.canaries.records import records_from_columns
from kvcanary.canaries.shape import WORDS
from kvcanary.canaries.span import CanarySpan, spans_from_columns

T = TypeVar("T")

COMPILED_SPELL = mint._load_spell()
COMPILED_RECORDS = records._load_core()
needs_core = pytest.mark.skipif(
    COMPILED_SPELL is None or COMPILED_RECORDS is None,
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


def python_records(cls: type[T], fields: tuple[str, ...], *columns: Any) -> tuple[T, ...]:
    saved, records.CORE = records.CORE, None
    try:
        return records_from_columns(cls, fields, *columns)
    finally:
        records.CORE = saved


SPAN_FIELDS = ("text", "char_offset", "token_offset", "index")
HIT_FIELDS = ("text", "start", "end", "layer", "canary", "origin", "owner")


@needs_core
@settings(max_examples=50, deadline=None)
@given(rows=st.lists(st.tuples(st.text(max_size=5), st.integers(), st.integers()), max_size=30))
def test_compiled_spans_equal_dataclass_spans(rows: list[tuple[str, int, int]]) -> None:
    texts = [r[0] for r in rows]
    chars, tokens = [r[1] for r in rows], tuple(r[2] for r in rows)
    got = spans_from_columns(texts, chars, tokens, range(len(rows)))
    assert type(got) is tuple
    made = tuple(CanarySpan(*r, i) for i, r in enumerate(rows))
    assert got == made
    assert list(map(hash, got)) == list(map(hash, made))
    assert got == python_records(CanarySpan, SPAN_FIELDS, texts, chars, tokens, range(len(rows)))
    assert all(map(gc.is_tracked, got))  # ordinary objects: the collector sees them


@pytest.mark.parametrize("compiled", [True, False])
def test_records_are_the_frozen_dataclass_they_stand_for(compiled: bool) -> None:
    if compiled and COMPILED_RECORDS is None:
        pytest.skip("canaries._columns was not built (no C compiler at install)")
    make = records_from_columns if compiled else python_records
    owner, origin = Owner("t", "r"), CanaryOrigin(1, 2, 3)
    columns = (["ydk a"], [4], [9], repeat("exact"), ["ydk a"], [origin], [owner])
    (hit,) = make(Hit, HIT_FIELDS, *columns)
    assert type(hit) is Hit
    assert hit == Hit("ydk a", 4, 9, "exact", "ydk a", origin, owner)
    assert hit.owner is owner
    with pytest.raises(dataclasses.FrozenInstanceError):
        hit.start = 5  # type: ignore[misc]
    assert make(Hit, HIT_FIELDS, [], [], [], repeat("exact"), [], [], []) == ()


class NotSlotted:
    text = property(lambda self: "x", lambda self, value: None)
    char_offset = token_offset = index = None


class SlottedDict(dict[str, int]):
    __slots__ = ("text",)


@pytest.mark.parametrize("compiled", [True, False])
def test_bad_classes_and_columns_are_refused(compiled: bool) -> None:
    if compiled and COMPILED_RECORDS is None:
        pytest.skip("canaries._columns was not built (no C compiler at install)")
    make = records_from_columns if compiled else python_records
    with pytest.raises(ValueError, match="different lengths"):
        make(CanarySpan, SPAN_FIELDS, ["a"], [1, 2], [1], [2])
    with pytest.raises(ValueError, match="one column for each field"):
        make(CanarySpan, SPAN_FIELDS, ["a"])
    with pytest.raises(TypeError, match="not a slot"):
        make(CanarySpan, ("text", "__init__", "token_offset", "index"), [], [], [], [])
    with pytest.raises(TypeError, match="not a slot"):  # a property: its setter runs code
        make(NotSlotted, SPAN_FIELDS, ["a"], [1], [1], [2])
    with pytest.raises(AttributeError):
        make(CanarySpan, ("text", "nothing", "token_offset", "index"), [], [], [], [])


@needs_core
def test_the_compiled_core_makes_only_what_object_new_may_make() -> None:
    assert COMPILED_RECORDS is not None
    with pytest.raises(TypeError, match="not safe"):  # object.__new__(SlottedDict) refuses
        COMPILED_RECORDS(SlottedDict, ("text",), ["a"])
    with pytest.raises(TypeError, match="list or a tuple"):
        COMPILED_RECORDS(CanarySpan, SPAN_FIELDS, ["a"], iter([1]), [1], [2])
    with pytest.raises(TypeError, match="type expected"):
        COMPILED_RECORDS(CanarySpan("a", 1, 2, 3), SPAN_FIELDS, [], [], [], [])


def test_a_prompt_is_the_same_without_the_compiled_helpers(
    cl100k: Tokenizer, minter: CanaryMinter
) -> None:
    def build() -> object:
        return build_prompt(cl100k, minter, tenant=2, request=3, num_tokens=40_000)

    compiled = build()
    saved = (mint._SPELL, records.CORE, getattr(cl100k, "_buffer", None))
    mint._SPELL, records.CORE = None, None
    if hasattr(cl100k, "_buffer"):
        cl100k._buffer = None  # count the list of token ids instead
    try:
        assert build() == compiled
    finally:
        mint._SPELL, records.CORE = saved[0], saved[1]
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
    assert records._load_core() is None

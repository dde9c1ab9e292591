"""Folding: what it maps to what, and the way back to original offsets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canaries import fold
from kvcanary.canaries.normalize import fold_readings


def test_ascii_folds_in_place() -> None:
    folded = fold("Hello, World-foo_bar\t12!")
    assert folded.text == "hello  world foo bar 12 "
    assert folded.original_span(7, 12) == (7, 12)


def test_unicode_disguises_fold_to_plain_words() -> None:
    cases = {
        "ｙｄｋ ＡＢＣ": "ydk abc",  # full width
        "y\u200bd\u200ck\u2060": "ydk",  # zero-width space, non-joiner, word joiner
        "ÝDK\u00a0café": "ydk cafe",  # accents stripped, no-break space
        "ydk\u2013word\u2014x": "ydk word x",  # en and em dashes
        "\U0001d432\U0001d41d\U0001d424": "ydk",  # mathematical bold letters
        "\ufb01ne ①": "fine 1",  # ligature and circled digit expand
    }
    for text, expected in cases.items():
        assert fold(text).text == expected, text


def test_offsets_map_back_across_deletions_and_expansions() -> None:
    text = "ab\u200bcd \ufb01x ｙｄｋ"
    folded = fold(text)
    assert folded.text == "abcd fix ydk"
    assert folded.original_span(0, 4) == (0, 5)  # the zero-width space lies inside
    assert folded.original_span(5, 8) == (6, 8)  # "fi" both come from the ligature
    assert folded.original_span(6, 8) == (6, 8)
    assert text[slice(*folded.original_span(9, 12))] == "ｙｄｋ"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(
        alphabet=st.sampled_from(list("abcXYZ -_.9\u200b\u00e9\ufb01ｙ\u2014\u0301 \n中")),
        max_size=40,
    ),
    data=st.data(),
)
def test_every_folded_span_comes_from_its_original_span(text: str, data: st.DataObject) -> None:
    folded = fold(text)
    assert set(folded.text) <= set("abcdefghijklmnopqrstuvwxyz0123456789 ")
    if not folded.text:
        return
    start = data.draw(st.integers(0, len(folded.text) - 1))
    end = data.draw(st.integers(start + 1, len(folded.text)))
    original_start, original_end = folded.original_span(start, end)
    assert 0 <= original_start < original_end <= len(text)
    assert folded.text[start:end] in fold(text[original_start:original_end]).text


def test_invisible_characters_have_two_readings() -> None:
    for invisible in ("\u200b", "\u2060", "\u00ad", "\ufeff", "\u200c", "\u200d", "\u2061"):
        text = f"settle{invisible}bishop y{invisible}dk"
        deleted, spaced = fold_readings(text)
        assert deleted.text == "settlebishop ydk", repr(invisible)
        assert spaced.text == "settle bishop y dk", repr(invisible)
        assert deleted == fold(text)
        assert text[slice(*spaced.original_span(7, 13))] == "bishop"
        assert text[slice(*deleted.original_span(13, 16))] == f"y{invisible}dk"


def test_text_without_invisible_characters_has_one_reading() -> None:
    for text in ("plain ascii", "café ｙｄｋ", "a\u0301b", ""):
        assert fold_readings(text) == (fold(text),)


def test_tokenizer_whitespace_markers_fold_to_spaces() -> None:
    cases = {
        "\u0120settle\u0120bishop\u010a": " settle bishop ",  # byte-level BPE Ġ and Ċ
        "\u2581settle\u2581bishop": " settle bishop",  # SentencePiece ▁
        "a\u0109b": "a b",  # byte-level BPE ĉ (a tab)
        "\u0121\u010b": "gc",  # the lower-case letters stay letters
    }
    for text, expected in cases.items():
        assert [r.text for r in fold_readings(text)] == [expected], repr(text)

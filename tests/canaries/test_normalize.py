"""Folding: what it maps to what, and the way back to original offsets."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from canaries import fold


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

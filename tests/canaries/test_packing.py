"""Packed canary spans: every span back exactly, a few characters a canary, bad input refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canaries import CanaryError, CanaryMinter, Tokenizer, build_prompt
from kvcanary.canaries.packing import pack_spans, unpack_spans
from kvcanary.canaries.span import CanarySpan


@pytest.mark.parametrize(("num_tokens", "page_size"), [(1, 16), (300, 16), (600, 16), (600, 64)])
def test_a_prompts_canaries_round_trip_in_about_fourteen_characters_each(
    cl100k: Tokenizer, minter: CanaryMinter, num_tokens: int, page_size: int
) -> None:
    prompt = build_prompt(
        cl100k, minter, tenant=3, request=77, num_tokens=num_tokens, page_size=page_size
    )
    packed = pack_spans(prompt.canaries)
    assert packed.isascii()
    assert not set(packed) & set('"\\ ')  # nothing JSON escapes
    assert packed == packed.lower()  # never a mixed-case run, which reads like a credential
    assert unpack_spans(packed) == prompt.canaries
    assert len(packed) <= 16 + 15 * len(prompt.canaries)


TEXTS = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["ydk", "ydk settle", "cnry alpha beta", ""]),
)


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    num=st.integers(0, 40),
    canonical=st.booleans(),
)
def test_any_spans_round_trip(
    minter: CanaryMinter, data: st.DataObject, num: int, canonical: bool
) -> None:
    numbers = st.integers(-(2**40), 2**40)
    spans = tuple(
        CanarySpan(
            minter.mint(1, 2, i) if canonical else data.draw(TEXTS),
            data.draw(numbers),
            data.draw(numbers),
            data.draw(st.sampled_from([i, data.draw(numbers)])),
        )
        for i in range(num)
    )
    assert unpack_spans(pack_spans(spans)) == spans


@pytest.mark.parametrize(
    "damaged",
    ["", "!!!", "AAAA", "_" * 40, "AQA.zz", "AQYA.", "AQYAAAAAAA.AAAAAAAAAAAA" + "A" * 5],
)
def test_damaged_packing_is_a_canary_error(damaged: str) -> None:
    with pytest.raises(CanaryError, match="packed canaries"):
        unpack_spans(damaged)


def test_truncated_or_extended_packing_is_refused(cl100k: Tokenizer, minter: CanaryMinter) -> None:
    packed = pack_spans(build_prompt(cl100k, minter, tenant=0, request=1, num_tokens=200).canaries)
    for damaged in (packed[:-2], packed + "AB", packed.replace(".", "..", 1)):
        with pytest.raises(CanaryError):
            unpack_spans(damaged)

"""Minting and attribution: determinism, secrecy, attribution without a table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canaries import TAG, WORDS, CanaryError, CanaryMinter, CanaryOrigin, Tokenizer
from kvcanary.canaries.mint import NUM_INDICES, NUM_REQUESTS, NUM_TENANTS


def test_same_seed_and_run_give_the_same_canaries() -> None:
    a, b = CanaryMinter.from_seed(1, "run"), CanaryMinter.from_seed(1, "run")
    assert a.mint(3, 4, 5) == b.mint(3, 4, 5)
    assert a.key_id == b.key_id
    assert CanaryMinter.from_seed(1, "run2").mint(3, 4, 5) != a.mint(3, 4, 5)
    assert CanaryMinter.from_seed(2, "run").mint(3, 4, 5) != a.mint(3, 4, 5)


def test_key_id_is_a_short_fingerprint_that_does_not_reveal_the_key() -> None:
    key = bytes(range(32))
    minter = CanaryMinter(key)
    assert len(minter.key_id) == 8
    assert int(minter.key_id, 16) >= 0
    assert key.hex()[:8] not in minter.key_id
    assert key.hex() not in repr(minter)
    assert minter.key_id != CanaryMinter(bytes(range(1, 33))).key_id
    assert CanaryMinter.random().key_id != CanaryMinter.random().key_id


def test_canary_shape_and_entropy(minter: CanaryMinter) -> None:
    canary = minter.mint(0, 0, 0)
    tag, *words = canary.split(" ")
    assert tag == TAG
    assert len(words) == 6
    assert all(word in WORDS for word in words)
    assert minter.num_bits == 70
    assert minter.num_bits >= 64
    assert minter.num_check_bits == 22


@settings(max_examples=60, deadline=None)
@given(
    tenant=st.integers(0, NUM_TENANTS - 1),
    request=st.integers(0, NUM_REQUESTS - 1),
    index=st.integers(0, NUM_INDICES - 1),
    num_words=st.integers(6, 10),
)
def test_attribution_recovers_the_origin(
    tenant: int, request: int, index: int, num_words: int
) -> None:
    minter = CanaryMinter.from_seed(3, "attr", num_words=num_words)
    canary = minter.mint(tenant, request, index)
    assert len(canary.split()) == num_words + 1
    assert minter.attribute(canary) == CanaryOrigin(tenant, request, index)
    assert minter.attribute("  " + canary.upper() + " ") == CanaryOrigin(tenant, request, index)


def test_batch_minting_equals_one_at_a_time(minter: CanaryMinter) -> None:
    batch = minter.mint_many(9, 1234, range(40))
    assert batch == [minter.mint(9, 1234, i) for i in range(40)]
    assert len(set(batch)) == 40
    origins = minter.attribute_many(batch)
    assert origins == [CanaryOrigin(9, 1234, i) for i in range(40)]


def test_attributing_more_canaries_than_the_cache_holds(minter: CanaryMinter) -> None:
    canaries = minter.mint_many(3, 3, range(70_000))  # more than the 65,536 remembered
    origins = minter.attribute_many(canaries)
    assert [o.index if o else -1 for o in origins] == list(range(70_000))
    assert minter.attribute(canaries[0]) == CanaryOrigin(3, 3, 0)


def test_other_runs_canaries_are_not_attributed(
    minter: CanaryMinter, other_minter: CanaryMinter
) -> None:
    foreign = other_minter.mint_many(1, 2, range(5000))
    assert sum(origin is not None for origin in minter.attribute_many(foreign)) == 0
    # eight canary words of another length, a word outside the list, no tag: not ours
    assert minter.attribute(" ".join([TAG, *WORDS[:8]])) is None
    assert minter.attribute(minter.mint(1, 2, 3).replace(TAG, "abc")) is None
    assert minter.attribute("hello world") is None


def test_digit_strings_the_cipher_never_produces_are_rejected(minter: CanaryMinter) -> None:
    # the largest spelling is worth more than 2**70: outside the cipher's range
    assert minter.attribute(" ".join([TAG, *[WORDS[-1]] * 6])) is None


def test_out_of_range_fields_are_errors(minter: CanaryMinter) -> None:
    with pytest.raises(CanaryError, match="tenant"):
        minter.mint(NUM_TENANTS, 0, 0)
    with pytest.raises(CanaryError, match="request"):
        minter.mint(0, -1, 0)
    with pytest.raises(CanaryError, match="index"):
        minter.mint(0, 0, NUM_INDICES)
    with pytest.raises(CanaryError, match="16 bytes"):
        CanaryMinter(b"short")
    with pytest.raises(CanaryError, match="num_words"):
        CanaryMinter.random(num_words=5)


@pytest.mark.parametrize("num_words", [6, 8, 10])
def test_every_canary_has_the_same_token_length_anywhere(cl100k: Tokenizer, num_words: int) -> None:
    minter = CanaryMinter.from_seed(5, "tokens", num_words=num_words)
    assert minter.num_tokens(cl100k) == num_words + 1
    for canary in minter.mint_many(2, 3, range(0, 3000, 7)):
        assert len(cl100k.encode(" " + canary)) == num_words + 1
        assert len(cl100k.encode("Hello there." + " " + canary + " The end.")) == len(
            cl100k.encode("Hello there. The end.")
        ) + (num_words + 1)

"""Canaries live in another index of the same run (`--ray`: one index per actor): a scan
asks the other indexes about the canary words it cannot place, and with what they name its
hits are those one index of every live canary gives."""

from __future__ import annotations

import pytest

from kvcanary.canaries import CanaryIndex, CanaryMinter, Owner
from kvcanary.canaries.elsewhere import foreign_kgrams, live_holding

ALICE, BOB = Owner("alice", "a-1"), Owner("bob", "b-1")
PROSE = "The farmer carried the old lantern across the bridge after the rain. "


@pytest.fixture
def pair(minter: CanaryMinter) -> tuple[CanaryIndex, CanaryIndex, list[str], list[str]]:
    """Alice's index and Bob's, each with its own tenant's live canaries."""
    mine, theirs = CanaryIndex(minter), CanaryIndex(minter)
    alice = minter.mint_many(0, 1, range(5))
    bob = minter.mint_many(1, 1, range(5))
    mine.add_many((canary, ALICE) for canary in alice)
    theirs.add_many((canary, BOB) for canary in bob)
    for index, elsewhere in ((mine, theirs), (theirs, mine)):
        index.live_elsewhere(len(elsewhere))
    return mine, theirs, alice, bob


def test_a_fragment_of_another_indexs_canary_is_found_through_it(
    pair: tuple[CanaryIndex, CanaryIndex, list[str], list[str]],
) -> None:
    mine, theirs, _, bob = pair
    words = bob[2].split()[1:]  # the tag cut: a fragment only
    text = f"{PROSE}Quoted: {' '.join(words)}. {PROSE}"
    one = CanaryIndex(mine.minter)  # one index of every live canary, as one process keeps
    one.add_many([*((c, ALICE) for c in pair[2]), *((c, BOB) for c in bob)])
    assert mine.scan(text) == []
    asked = foreign_kgrams(mine, text, mine.scan(text))
    assert asked
    assert all(kgram in " ".join(words) for kgram in asked)
    named = live_holding(theirs, asked)
    assert named == [(bob[2], BOB)]
    mine.add_many(named)
    found = [(h.layer, h.canary, h.owner, h.start, h.end) for h in mine.scan(text)]
    assert found == [(h.layer, h.canary, h.owner, h.start, h.end) for h in one.scan(text)]
    assert found[0][:3] == ("fragment", bob[2], BOB)


def test_an_echo_of_the_tenants_own_canaries_asks_nothing(
    pair: tuple[CanaryIndex, CanaryIndex, list[str], list[str]],
) -> None:
    mine, _, alice, _ = pair
    text = f"{PROSE}{alice[0]} {alice[1]} filler words {PROSE}"
    hits = mine.scan(text)
    assert {hit.canary for hit in hits} == {alice[0], alice[1]}
    assert foreign_kgrams(mine, text, hits) == set()
    assert foreign_kgrams(mine, PROSE * 3, []) == set()


def test_words_no_live_canary_holds_are_named_by_no_index(
    pair: tuple[CanaryIndex, CanaryIndex, list[str], list[str]], minter: CanaryMinter
) -> None:
    mine, theirs, _, _ = pair
    stranger = minter.mint(7, 7, 7).split()[1:]  # minted, never live anywhere
    text = f"{PROSE}{' '.join(stranger)}."
    asked = foreign_kgrams(mine, text, [])
    assert asked  # its words are canary words: asked about...
    assert live_holding(theirs, asked) == []  # ...and nobody holds them


def test_the_fragment_rule_counts_the_canaries_live_elsewhere(minter: CanaryMinter) -> None:
    """The near zone is that of one index of all: V counts the other indexes' canaries."""
    alone, shared = CanaryIndex(minter), CanaryIndex(minter)
    canary = minter.mint(0, 1, 0)
    for index in (alone, shared):
        index.add(canary, ALICE)
    shared.live_elsewhere(1 << 17)
    one = CanaryIndex(minter)  # one index of them all
    one.add_many((canary, BOB) for canary in minter.mint_many(1, 1, range(1 << 17)))
    one.add(canary, ALICE)
    at = 5000  # in the near zone of one live canary, beyond that of 2**17
    assert (alone.fragment_words_at(at), shared.fragment_words_at(at)) == (5, 6)
    assert shared.fragment_words_at(at) == one.fragment_words_at(at)

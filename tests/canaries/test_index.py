"""Detection: layers, streaming across chunk boundaries, attribution, benign text."""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canaries import (
    TAG,
    WORDS,
    CanaryError,
    CanaryIndex,
    CanaryMinter,
    CanaryOrigin,
    Hit,
    Owner,
    Relation,
    classify,
    min_fragment_words,
)
from kvcanary.canaries.index import SCAN_BLOCK
from kvcanary.canaries.shape import WORD_INDEX

ALICE_1, ALICE_2, BOB_1 = Owner("alice", "a-1"), Owner("alice", "a-2"), Owner("bob", "b-1")
PROSE = (
    "The farmer carried the old lantern across the bridge. We waited by the market until "
    "the tower looked bright. Nobody opened the kitchen window after the rain. "
)


def owners_by_origin(origin: CanaryOrigin) -> Owner | None:
    return {(0, 1): ALICE_1, (0, 2): ALICE_2, (1, 1): BOB_1}.get((origin.tenant, origin.request))


@pytest.fixture(scope="module")
def live(minter: CanaryMinter) -> dict[str, Owner]:
    canaries = {}
    for (tenant, request), owner in [((0, 1), ALICE_1), ((0, 2), ALICE_2), ((1, 1), BOB_1)]:
        for canary in minter.mint_many(tenant, request, range(20)):
            canaries[canary] = owner
    return canaries


@pytest.fixture(scope="module")
def index(minter: CanaryMinter, live: dict[str, Owner]) -> CanaryIndex:
    index = CanaryIndex(minter, owner_of=owners_by_origin)
    index.add_many(live.items())
    return index


def scan_in_chunks(
    index: CanaryIndex, text: str, cuts: Sequence[int], scan_block: int = SCAN_BLOCK
) -> list[Hit]:
    scanner = index.scanner(scan_block=scan_block)
    hits: list[Hit] = []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for start, end in itertools.pairwise(bounds):
        hits += scanner.feed(text[start:end])
    return hits + scanner.finish()


BLOCKS = st.sampled_from([1, 5, 64, 700, SCAN_BLOCK])


def fullwidth(text: str) -> str:
    return "".join("\u3000" if c == " " else chr(ord(c) + 0xFEE0) for c in text)


FORMS: dict[str, tuple[Callable[[str], str], str]] = {
    "exact": (lambda c: c, "exact"),
    "upper": (str.upper, "normalized"),
    "hyphens": (lambda c: c.replace(" ", "-"), "normalized"),
    "title_underscores": (lambda c: c.title().replace(" ", "_"), "normalized"),
    "zero_width": (lambda c: "\u200b".join(c), "normalized"),
    "line_breaks": (lambda c: c.replace(" ", " \n\t "), "normalized"),
    "full_width": (fullwidth, "normalized"),
    "dashes_soft_hyphens": (
        lambda c: c.replace(" ", "\u2014").replace("e", "e\u00ad"),
        "normalized",
    ),
    "fragment": (lambda c: c.split(" ", 1)[1], "fragment"),
    "fragment_upper_hyphens": (lambda c: c.split(" ", 1)[1].upper().replace(" ", "-"), "fragment"),
}


def test_exact_canary_is_found_once_with_offsets_origin_and_owner(
    index: CanaryIndex, live: dict[str, Owner]
) -> None:
    canary = next(c for c, owner in live.items() if owner == BOB_1)
    text = f"Sure. Here it is: {canary}. Done."
    hits = index.scan(text)
    assert len(hits) == 1
    hit = hits[0]
    assert (hit.start, hit.end) == (18, 18 + len(canary))
    assert hit.text == canary
    assert (hit.layer, hit.canary, hit.owner) == ("exact", canary, BOB_1)
    assert hit.origin is not None
    assert (hit.origin.tenant, hit.origin.request) == (1, 1)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_form_is_found_once_and_attributed(
    index: CanaryIndex, live: dict[str, Owner], form: str
) -> None:
    canary, owner = list(live.items())[25]
    disguise, layer = FORMS[form]
    shown = disguise(canary)
    text = PROSE + shown + ". " + PROSE
    hits = index.scan(text)
    assert [(h.layer, h.canary, h.owner) for h in hits] == [(layer, canary, owner)]
    assert (hits[0].start, hits[0].end) == (len(PROSE), len(PROSE) + len(shown.rstrip("\u00ad")))
    assert text[hits[0].start : hits[0].end] == hits[0].text


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_chunk_boundaries_never_hide_or_duplicate_a_hit(
    index: CanaryIndex, live: dict[str, Owner], data: st.DataObject
) -> None:
    items = list(live.items())
    num_items = data.draw(st.integers(1, 8))
    pad = data.draw(st.sampled_from([0, 0, SCAN_BLOCK + 123]))
    pieces, expected = [PROSE], []
    for _ in range(num_items):
        canary, owner = items[data.draw(st.integers(0, len(items) - 1))]
        form = data.draw(st.sampled_from(sorted(FORMS)))
        shown = FORMS[form][0](canary).rstrip("\u00ad")
        start = sum(map(len, pieces))
        expected.append((start, start + len(shown), FORMS[form][1], canary, owner))
        pieces += [shown, ". ", PROSE[: data.draw(st.integers(0, len(PROSE)))], "x" * pad, " "]
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    if data.draw(st.booleans()) and len(text) < 3000:  # a token-by-token stream
        cuts = list(range(0, len(text), data.draw(st.integers(1, 7))))
    hits = scan_in_chunks(index, text, cuts, data.draw(BLOCKS))
    assert [(h.start, h.end, h.layer, h.canary, h.owner) for h in hits] == expected
    assert all(text[h.start : h.end] == h.text for h in hits)
    assert hits == index.scan(text)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_merged_fragments_and_trailing_invisibles_survive_chunking(data: st.DataObject) -> None:
    minter = CanaryMinter.from_seed(9, "long", num_words=8)
    index = CanaryIndex(minter)
    canary = minter.mint(1, 2, 3)
    index.add(canary, BOB_1)
    words = canary.split()[1:]
    shown = data.draw(
        st.sampled_from([" ".join(words), " ".join(words[:7]), "-".join(words[1:]).upper()])
    )
    invisible = "\u200b" * data.draw(st.integers(0, 300))
    tail = data.draw(st.sampled_from([". The end.", "xyz and more"]))  # letters glue on
    text = PROSE + shown + invisible + tail
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    hits = scan_in_chunks(index, text, cuts, data.draw(BLOCKS))
    if tail.startswith(".") or invisible:  # read as a space, an invisible run separates
        assert [(h.start, h.text, h.layer) for h in hits] == [(len(PROSE), shown, "fragment")]
    else:  # the last word runs into "xyz": only a shorter fragment may remain
        assert all(h.end <= len(PROSE) + len(shown) - 7 for h in hits)
    assert hits == index.scan(text)


def test_fragments_shorter_than_the_minimum_are_not_hits(
    index: CanaryIndex, live: dict[str, Owner]
) -> None:
    assert index.fragment_words == 5  # with 60 live canaries, anywhere in a 1 MiB response
    assert index.fragment_words_at(1 << 20) == 5
    canary = next(iter(live))
    four_words = " ".join(canary.split()[1:5])
    assert index.scan(f"{PROSE} {four_words}. {PROSE}") == []
    assert index.scan(" ".join(canary.split()[:5])) == []  # tag and four words


def test_five_words_from_any_position_with_or_without_the_tag_are_attributed(
    index: CanaryIndex, live: dict[str, Owner]
) -> None:
    canary, owner = list(live.items())[45]
    words = canary.split()[1:]
    assert "settle" in WORD_INDEX
    shown = [
        " ".join(words[:5]),  # no tag, first five
        " ".join(words[1:]),  # no tag, last five
        f"{TAG} " + " ".join(words[:5]),  # the tag and five words
        words[0][2:] + " " + " ".join(words[1:]),  # lost the tag and half its first word
        f"{TAG} settle " + " ".join(words),  # a stray tag and a list word before it
        f"{TAG} " + " ".join(words[:5]) + " settle",  # five words, then a list word
    ]
    for text in shown:
        hits = index.scan(f"{PROSE}{text}. {PROSE}")
        assert [(h.layer, h.canary, h.owner) for h in hits] == [("fragment", canary, owner)], text
        assert hits[0].text in text


def test_fragment_lengths_follow_the_live_count_and_the_offset() -> None:
    minter = CanaryMinter.from_seed(5, "rule")
    rule = CanaryIndex(minter).fragment_rule
    assert rule is not None
    assert (rule.near_words, rule.far_words) == (5, 6)
    assert [rule.near_chars(v) for v in (1 << 20, 1 << 17, 100_000)] == [413, 3353, 4396]
    assert rule.words_at(412, 1 << 20) == 5
    assert rule.words_at(413, 1 << 20) == 6
    # the documented bound: far zone everywhere, near zone in the rest of the budget
    far = 2 * (1 << 20) / 7 * (1 << 20) * 2.0**-70
    assert 1e-10 < far < 1e-9
    assert far + 59 * (1 << 20) * rule.near_cost <= 1e-9  # 59 word starts, 413 chars


def test_longer_canaries_allow_fragments_that_lose_words() -> None:
    minter = CanaryMinter.from_seed(9, "long", num_words=8)
    index = CanaryIndex(minter)
    assert index.fragment_words == 5
    canary = minter.mint(3, 4, 5)
    index.add(canary, ALICE_1)
    words = canary.split()[1:]
    for shown in (" ".join(words[:5]), " ".join(words[3:]), " ".join(words)):
        hits = index.scan(f"Quote: {shown}, end")
        assert [(h.layer, h.canary, h.text) for h in hits] == [("fragment", canary, shown)]
        assert hits[0].origin == CanaryOrigin(3, 4, 5)
    assert index.scan("Quote: " + " ".join(words[:4]) + ".") == []


def test_fragment_bound_matches_the_documented_formula_and_table() -> None:
    sizes = {
        w: min_fragment_words(CanaryMinter.from_seed(0, "x", num_words=w)) for w in range(6, 11)
    }
    assert sizes == {6: 6, 7: 6, 8: 6, 9: 7, 10: 7}
    six = CanaryMinter.from_seed(0, "x")
    assert min_fragment_words(six, max_live=1 << 24) is None  # not even a whole canary
    assert min_fragment_words(six, max_live=1 << 10, max_response_chars=1 << 16) == 5
    assert CanaryIndex(six, max_live=1 << 24).fragment_words is None


def test_other_runs_canaries_are_unknown_origin(
    index: CanaryIndex, other_minter: CanaryMinter
) -> None:
    foreign = other_minter.mint(0, 1, 0)  # same fields, another key
    hits = index.scan(f"leaked: {foreign.upper()}")
    assert [(h.layer, h.canary, h.origin, h.owner) for h in hits] == [
        ("normalized", foreign, None, None)
    ]
    assert classify(hits[0], tenant="alice", request_id="a-1") is Relation.UNKNOWN
    longer = CanaryMinter.from_seed(1, "seven", num_words=7).mint(0, 0, 0)
    assert [h.canary for h in index.scan(longer)] == [" ".join(longer.split()[:7])]


def test_shorter_foreign_canaries_are_found_by_longer_minters() -> None:
    index = CanaryIndex(CanaryMinter.from_seed(9, "long", num_words=8))
    foreign = CanaryMinter.from_seed(1, "six").mint(0, 0, 0)
    hits = index.scan(f"see {foreign}. The end")
    assert [(h.canary, h.owner, h.origin) for h in hits] == [(foreign, None, None)]


def test_attributed_canaries_that_are_not_live_resolve_through_owner_of(
    minter: CanaryMinter,
) -> None:
    canary = minter.mint(0, 2, 999)  # minted for alice's a-2 but never registered
    with_lookup = CanaryIndex(minter, owner_of=owners_by_origin).scan(canary)
    assert [(h.origin, h.owner) for h in with_lookup] == [(CanaryOrigin(0, 2, 999), ALICE_2)]
    without = CanaryIndex(minter).scan(canary)
    assert [(h.origin, h.owner) for h in without] == [(CanaryOrigin(0, 2, 999), None)]


def test_classify_relates_hits_to_the_receiving_request(
    index: CanaryIndex, live: dict[str, Owner]
) -> None:
    text = " | ".join(live)
    relations = {classify(h, tenant="alice", request_id="a-1") for h in index.scan(text)}
    assert relations == {Relation.OWN, Relation.SAME_TENANT, Relation.OTHER_TENANT}
    by_owner = {h.owner: classify(h, tenant="alice", request_id="a-1") for h in index.scan(text)}
    assert by_owner == {
        ALICE_1: Relation.OWN,
        ALICE_2: Relation.SAME_TENANT,
        BOB_1: Relation.OTHER_TENANT,
    }


def test_repeated_and_adjacent_canaries_are_each_found(
    index: CanaryIndex, live: dict[str, Owner]
) -> None:
    a, b = list(live)[:2]
    assert len(index.scan(" ".join([a, b] * 500))) == 1000
    assert [h.canary for h in index.scan(f"{a}\n{b}")] == [a, b]


def benign_corpus() -> list[str]:
    rng = random.Random(1)
    hex_blob = " ".join(rng.randbytes(16).hex() for _ in range(2000))
    base32 = " ".join(
        __import__("base64").b32encode(rng.randbytes(20)).decode() for _ in range(2000)
    )
    uuids = "\n".join(str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(2000))
    hyphens = " ".join(
        "-".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9))) for _ in range(3000)
    )
    listy = " ".join(rng.choice(WORDS) for _ in range(60000))  # canary words, none live
    code = (
        "def decode(buffer: bytes) -> str:\n    return buffer.decode('utf-8')\n"
        "for (int i = 0; i < n; ++i) { total += values[i]; }\n"
        "SELECT tenant, request_id FROM canaries WHERE ydk_version = 2;\n"
    ) * 500
    mentions = "The ydk toolkit generates models. YDK-gen and ydk_py are packages. " * 200
    prose = (PROSE + "It was a quiet, simple evening; nothing unusual happened at all. ") * 500
    invisible = listy[:70000].replace(" ", "\u200b")  # both readings of invisible separators
    byte_level = "\u0120" + listy[:70000].replace(" ", "\u0120")  # raw byte-level BPE
    return [prose, prose.upper(), hex_blob, base32, base32.lower(), uuids, hyphens, listy,
            invisible, byte_level, code, mentions]  # fmt: skip


def test_benign_text_gives_no_hit_with_many_live_canaries(minter: CanaryMinter) -> None:
    index = CanaryIndex(minter)
    for request in range(20):
        index.add_many((c, ALICE_1) for c in minter.mint_many(0, request, range(5000)))
    assert len(index) == 100_000
    for text in benign_corpus():
        assert index.scan(text) == [], text[:60]
    # with 100,000 live canaries, five words are enough in the first 4,354 characters only
    canary = minter.mint(0, 3, 7)
    five = " ".join(canary.split()[2:])
    assert index.fragment_words_at(4353) == 5
    assert [h.canary for h in index.scan(f"{PROSE}{five}.")] == [canary]
    assert index.scan("x" * 4400 + f" {five}.") == []
    assert [h.canary for h in index.scan("x" * 4400 + f" {canary}.")] == [canary]


@pytest.mark.parametrize("scan_block", [100, SCAN_BLOCK])
def test_memory_stays_bounded_on_long_streams(
    index: CanaryIndex, live: dict[str, Owner], scan_block: int
) -> None:
    scanner = index.scanner(scan_block=scan_block)
    canary = next(iter(live))
    chunk = (PROSE * 8)[:1000]
    found = []
    for i in range(5000):
        found += scanner.feed(chunk if i % 1000 else f"{chunk[: -len(canary) - 2]} {canary} ")
        assert scanner.num_buffered <= SCAN_BLOCK + 2000
    found += scanner.finish()
    assert [h.start for h in found] == [i * 1_000_000 + 999 - len(canary) for i in range(5)]


def test_feed_after_finish_is_an_error(index: CanaryIndex) -> None:
    scanner = index.scanner()
    scanner.feed("hello")
    assert scanner.finish() == []
    assert scanner.finish() == []
    with pytest.raises(CanaryError, match="after finish"):
        scanner.feed("more")


def test_adding_discarding_and_limits(minter: CanaryMinter) -> None:
    index = CanaryIndex(minter, max_live=3)
    a, b, c, d = minter.mint_many(0, 7, range(4))
    index.add(a.upper() + "  ", ALICE_1)  # canonicalised
    assert a in index
    assert index.owner(a) == ALICE_1
    index.add_many([(b, ALICE_1), (c, ALICE_1)])
    with pytest.raises(CanaryError, match="more than 3 live canaries"):
        index.add(d, ALICE_1)
    index.discard(a)
    assert a not in index
    assert len(index) == 2
    assert [h.owner for h in index.scan(a.split(" ", 1)[1])] == []  # its fragment is gone
    assert [h.owner for h in index.scan(a)] == [None]  # still attributable, no owner
    with pytest.raises(CanaryError, match="word list"):
        index.add(f"{TAG} aaaaaa bbbbbb cccccc dddddd eeeeee ffffff", ALICE_1)
    with pytest.raises(CanaryError, match="number of words"):
        index.add(minter.mint(0, 0, 0).rsplit(" ", 1)[0], ALICE_1)

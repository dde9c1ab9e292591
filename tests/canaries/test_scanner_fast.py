"""The fast scanning path agrees with the pure-Python reference on any text and chunking."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canaries import WORDS, CanaryIndex, CanaryMinter, Hit, Owner, scanner_fast
from kvcanary.canaries.scanner_fast import MAX_MATCH, fold_bytes, fragment_windows, tag_starts

ALICE, BOB = Owner("alice", "a-1"), Owner("bob", "b-1")
COMPILED = scanner_fast._load_core()
CORES = [
    pytest.param(
        "compiled",
        marks=pytest.mark.skipif(
            COMPILED is None, reason="canaries._foldscan was not built (no C compiler at install)"
        ),
    ),
    "python",
]
"""The fast path's two ways to fold and find the fragment windows: both are judged."""


@contextmanager
def using(core: str) -> Iterator[None]:
    saved = scanner_fast.CORE
    scanner_fast.CORE = COMPILED if core == "compiled" else None
    try:
        yield
    finally:
        scanner_fast.CORE = saved


@pytest.fixture(scope="module")
def live(minter: CanaryMinter) -> list[str]:
    return minter.mint_many(0, 1, range(8)) + minter.mint_many(1, 1, range(8))


@pytest.fixture(scope="module")
def index(minter: CanaryMinter, live: list[str]) -> CanaryIndex:
    index = CanaryIndex(minter)
    index.add_many((canary, ALICE if i < 8 else BOB) for i, canary in enumerate(live))
    return index


def disguise(canary: str, how: int) -> str:
    words = canary.split(" ")
    if how == 0:
        return canary.upper()
    if how == 1:
        return "-".join(words)
    if how == 2:
        return " ".join(w[:2] + "\u200b" + w[2:] for w in words)  # zero-width, inside words
    if how == 3:
        return "\uff59\uff44\uff4b " + " ".join(words[1:])  # full-width tag
    if how == 4:
        return "  ".join(words)  # double spaces: a tag run, never a fragment
    return canary + "\u200b" + WORDS[how]  # an invisible, then another word


def pieces(live: list[str], foreign: list[str]) -> st.SearchStrategy[str]:
    canary = st.sampled_from(live)
    words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join)
    fragment = st.tuples(canary, st.integers(0, 2), st.integers(4, 6)).map(
        lambda t: " ".join(t[0].split(" ")[1 + t[1] : 1 + t[1] + t[2]])
    )
    filler = st.sampled_from(
        [" ", ". ", "\n\n", ", it\u2019s \u201cso\u201d \u2014 ", " caf\u00e9 ", " 42 ", " ydk "]
    )
    long_filler = st.integers(1, 3).map(lambda n: "The farmer waited by the bridge. " * 10 * n)
    return st.one_of(
        canary,
        st.tuples(canary, st.integers(0, 5)).map(lambda t: disguise(*t)),
        fragment,
        st.sampled_from(foreign),
        words,
        filler,
        long_filler,
        st.sampled_from(["\U0001f600", "\ufb03", "e\u0301", "\u00ad"]),  # astral, ligature, ...
    )


def scan(
    index: CanaryIndex,
    text: str,
    cuts: Sequence[int],
    block: int,
    ref: bool,
    exact_only: bool = False,
) -> list[Hit]:
    scanner = index.scanner(scan_block=block, reference=ref, exact_only=exact_only)
    hits, previous = [], 0
    for cut in [*sorted(cuts), len(text)]:
        hits += scanner.feed(text[previous:cut])
        previous = cut
    return hits + scanner.finish()


@pytest.mark.parametrize("core", CORES)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_fast_path_reports_exactly_the_oracles_hits(
    core: str,
    data: st.DataObject,
    index: CanaryIndex,
    live: list[str],
    other_minter: CanaryMinter,
) -> None:
    foreign = other_minter.mint_many(0, 1, range(4))
    text = "".join(data.draw(st.lists(pieces(live, foreign), max_size=30)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    block = data.draw(st.sampled_from([1, 7, 64, 1000, 1 << 15]))
    with using(core):
        fast = scan(index, text, cuts, block, ref=False)
    assert fast == scan(index, text, cuts, block, ref=True)


@pytest.mark.parametrize("core", CORES)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_exact_layer_alone_reports_exactly_the_oracles_exact_hits(
    core: str,
    data: st.DataObject,
    index: CanaryIndex,
    live: list[str],
    other_minter: CanaryMinter,
) -> None:
    foreign = other_minter.mint_many(0, 1, range(4))
    text = "".join(data.draw(st.lists(pieces(live, foreign), max_size=30)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    block = data.draw(st.sampled_from([1, 7, 64, 1000, 1 << 15]))
    oracle = [hit for hit in scan(index, text, cuts, block, ref=True) if hit.layer == "exact"]
    with using(core):
        assert scan(index, text, cuts, block, ref=False, exact_only=True) == oracle


def test_the_exact_layer_alone_resolves_unclear_candidates_with_the_oracle(
    index: CanaryIndex, live: list[str], other_minter: CanaryMinter
) -> None:
    foreign = other_minter.mint_many(0, 1, [0])[0]  # verbatim, but not live: unknown origin
    text = (
        f"{live[0]}. \u201c{live[1]}\u201d x{live[2]} {live[3]}\u200b {foreign} "
        f"{live[4].upper()} {live[5]}-{live[6]}"
    )
    hits = scan(index, text, [], 1 << 15, ref=False, exact_only=True)
    assert hits == [h for h in scan(index, text, [], 1 << 15, ref=True) if h.layer == "exact"]
    assert [h.canary for h in hits] == [live[0], live[1], live[3], foreign, live[5], live[6]]
    assert [h.owner for h in hits] == [ALICE] * 3 + [None, ALICE, ALICE]


CHARS = st.one_of(
    st.sampled_from("abcdefxyzYDK0129 -.,\n\x7f"),
    st.sampled_from("\u201c\u201d\u2019\u2014\u00e9\u00c9\uff59\uff44\uff4b\u0120\u2581"),
    st.sampled_from("\u200b\u00ad\ufb03\u0301\U0001f600\ud800\u2026"),
    st.characters(),
)


def compiled_fold(text: str, k: int) -> tuple[bytes, list[int], list[int]] | None:
    """The compiled core's folding, windows and tags, the positions unpacked."""
    assert COMPILED is not None
    got = COMPILED(text, k, scanner_fast._fold_code)
    if got is None:
        return None
    lowered, windows, tags = got
    return lowered, memoryview(windows).cast("n").tolist(), memoryview(tags).cast("n").tolist()


@pytest.mark.skipif(COMPILED is None, reason="canaries._foldscan was not built")
@settings(max_examples=300, deadline=None)
@given(
    words=st.lists(
        st.one_of(
            st.text(CHARS, max_size=8),
            st.sampled_from(WORDS),
            st.sampled_from([" ", "-", "\u201c", "\u2014", "1"]),
            st.sampled_from(["ydk", "YDK", "\uff59\uff44\uff4b", "yydk", "ydkydk"]),
        ),
        max_size=40,
    ),
    k=st.integers(0, 6),
)
def test_the_compiled_core_folds_and_finds_windows_and_tags_as_the_python_steps_do(
    words: list[str], k: int
) -> None:
    assert COMPILED is not None
    text = "".join(words)
    lowered = fold_bytes(text)
    got = compiled_fold(text, k)
    if lowered is None:
        assert got is None
    else:
        assert got == (lowered, fragment_windows(lowered, k) if k else [], tag_starts(lowered))


@pytest.mark.skipif(COMPILED is None, reason="canaries._foldscan was not built")
def test_the_compiled_core_passes_on_a_failing_folding_and_refuses_a_bad_one() -> None:
    assert COMPILED is not None

    def broken(code: int) -> int:
        raise LookupError(code)

    with pytest.raises(LookupError):  # code points no other test sees: not cached yet
        COMPILED("ab \ue0a1 cd", 5, broken)
    with pytest.raises(ValueError, match="not an ASCII code"):
        COMPILED("ab \ue0a2 cd", 5, lambda code: 200)
    text = "ab \ue0a1 \ue0a2"  # private use: a separator, once the folding is right
    assert COMPILED(text, 5, scanner_fast._fold_code) == (fold_bytes(text), b"", b"")


def test_seeds_far_apart_are_resolved_in_separate_windows(
    index: CanaryIndex, live: list[str], other_minter: CanaryMinter
) -> None:
    far = " The farmer waited by the bridge. " * (3 * MAX_MATCH // 30)
    fragment = " ".join(live[3].split(" ")[2:7])
    parts = [live[0], disguise(live[1], 0), fragment, other_minter.mint_many(0, 1, [0])[0]]
    text = far + far.join(parts) + far + live[2]
    hits = index.scan(text)
    assert hits == index._find_oracle(" " + text + " ", -1, -1, len(text))
    assert [h.layer for h in hits] == ["exact", "normalized", "fragment", "exact", "exact"]
    assert [h.owner for h in hits] == [ALICE, ALICE, ALICE, None, ALICE]


def test_windows_that_cut_through_an_exact_canary_report_no_piece_of_it(
    index: CanaryIndex, live: list[str]
) -> None:
    seed = disguise(live[1], 0)  # resolved by the oracle in a window around it
    for gap in range(MAX_MATCH - 60, MAX_MATCH + 8):
        for text in (seed + " " * gap + live[0] + ".", live[0] + " " * gap + seed + "."):
            hits = index.scan(text)
            assert hits == scan(index, text, [], 1 << 15, ref=True)
            assert [h.layer for h in hits].count("exact") == 1, gap


def test_echoed_canaries_back_to_back_are_exact_hits(index: CanaryIndex, live: list[str]) -> None:
    text = " ".join(live) + ". " + "\n".join(live)
    hits = index.scan(text)
    assert hits == scan(index, text, [], 1 << 15, ref=True)
    assert [h.canary for h in hits] == live + live
    assert {h.layer for h in hits} == {"exact"}


def test_folding_in_bytes_is_one_to_one_or_refused() -> None:
    assert fold_bytes("Ydk Word") == b"ydk word"
    assert fold_bytes("caf\u00e9 \u201cok\u201d") == b"cafe  ok "
    assert fold_bytes("\uff59\uff44\uff4b") == b"ydk"
    for refused in ["a\u200bb", "\ufb03", "e\u0301", "\U0001f600", "\u00ad"]:
        assert fold_bytes(refused) is None


def test_a_literal_del_next_to_non_ascii_text_goes_to_the_oracle(
    index: CanaryIndex, live: list[str]
) -> None:
    text = f"caf\u00e9 \x7f {disguise(live[0], 0)} \u201c{live[1]}\u201d"
    assert fold_bytes(text) is None  # DEL stands for "does not fold one-to-one"
    hits = index.scan(text)
    assert hits == scan(index, text, [], 1 << 15, ref=True)
    assert [h.layer for h in hits] == ["normalized", "exact"]


@pytest.mark.skipif(COMPILED is None, reason="canaries._foldscan was not built")
def test_the_compiled_core_finds_no_windows_for_k_below_one_and_long_ones_for_large_k() -> None:
    assert COMPILED is not None
    text = "YDK settle bishop "
    lowered = fold_bytes(text)
    assert lowered is not None
    for k in (0, -1):
        assert compiled_fold(text, k) == (lowered, [], [0])
    assert compiled_fold(text, 1) == (lowered, [3, 10], [0])
    assert compiled_fold(text, 2) == (lowered, [3], [0])
    assert compiled_fold(text, 3) == (lowered, [], [0])


@pytest.mark.skipif(COMPILED is None, reason="canaries._foldscan was not built")
@settings(max_examples=300, deadline=None)
@given(
    words=st.lists(
        st.one_of(
            st.text(CHARS, max_size=20),
            st.sampled_from(["ydk ", "ydk", "yydk  ", " dk ", "\u201cydk ", "\U0001f600ydk "]),
        ),
        max_size=40,
    )
)
def test_the_compiled_core_finds_every_raw_tag_in_any_kind_of_str(words: list[str]) -> None:
    from kvcanary.canaries._foldscan import exact_scan

    text = "".join(words)
    every, position = [], text.find("ydk ")
    while position >= 0:
        every.append(position)
        position = text.find("ydk ", position + 1)
    none_live = exact_scan(text, None, 10, {}, {}, None, "ydk ", Hit, 0, -1, len(text), None, 0)
    assert none_live == ([], [], every, None)


@pytest.mark.skipif(COMPILED is None, reason="canaries._foldscan was not built")
def test_the_compiled_core_finds_raw_tags_close_together_at_every_alignment() -> None:
    from kvcanary.canaries._foldscan import exact_scan

    for kind in ("", "\u201c", "\U0001f600"):  # 1-, 2- and 4-byte strs
        for offset in range(40):
            text = kind + "x" * offset + "ydk ydk yxk ydk y k ydk" + " ydk " * 9 + "ydk "
            every, position = [], text.find("ydk ")
            while position >= 0:
                every.append(position)
                position = text.find("ydk ", position + 1)
            found = exact_scan(text, None, 10, {}, {}, None, "ydk ", Hit, 0, -1, 99, None, 0)
            assert found[2] == every


@pytest.mark.skipif(COMPILED is None, reason="canaries._foldscan was not built")
@settings(max_examples=300, deadline=None)
@given(
    windows=st.lists(st.integers(0, 400), unique=True).map(sorted),
    gaps=st.lists(st.integers(1, 60), max_size=12),
    width=st.integers(1, 50),
    span=st.tuples(st.integers(-1, 1000), st.integers(-1, 1000)),
)
def test_the_compiled_core_makes_the_exact_hits_and_drops_the_windows_touching_them(
    windows: list[int], gaps: list[int], width: int, span: tuple[int, int]
) -> None:
    from kvcanary.canaries._foldscan import exact_scan

    canary, owner, base = "ydk " + "x" * 16, Owner("t", "r"), 7  # 20 characters, live
    starts, end = [], 0
    for gap in gaps:  # separated by spaces
        starts.append(end + gap)
        end = starts[-1] + 20
    text = "".join(" " * gap + canary for gap in gaps) + " "
    after, until = span
    live, resolved = {canary: owner}, {canary: (canary, owner, None)}
    at = struct.pack(f"{len(windows)}n", *windows)  # packed positions, as fold_scan gives
    args = (text, None, 20, live, resolved, None, "ydk ", Hit, base, after, until, at, width)
    hits, missing, seeds, kept = exact_scan(*args)
    expected = scanner_fast._outside(windows, starts, 20, width) if starts and windows else windows
    assert (missing, seeds, kept) == ([], [], expected)
    chosen = [s for s in starts if after < base + s + 20 <= until]
    fields = [(h.text, h.start, h.end, h.layer, h.canary, h.origin, h.owner) for h in hits]
    assert fields == [
        (canary, base + s, base + s + 20, "exact", canary, None, owner) for s in chosen
    ]
    assert exact_scan(text, None, 20, live, {}, *args[5:])[:3] == ([], [canary] * len(starts), [])


class PropertyHit:
    """Hit's field names as properties: storing through them would run Python code."""

    text = start = end = layer = canary = origin = owner = property(
        lambda self: None, lambda self, value: None
    )


@pytest.mark.skipif(COMPILED is None, reason="canaries._foldscan was not built")
def test_the_compiled_core_makes_hits_of_a_slotted_class_only() -> None:
    from kvcanary.canaries._foldscan import exact_scan

    canary = "ydk " + "x" * 16
    args = (f" {canary} ", None, 20, {canary: None}, {canary: (canary, None, None)}, None)
    (hit,), *_ = exact_scan(*args, "ydk ", Hit, 0, -1, 99, None, 0)
    assert hit == Hit(canary, 1, 21, "exact", canary, None, None)
    with pytest.raises(TypeError, match="not a slot"):
        exact_scan(*args, "ydk ", PropertyHit, 0, -1, 99, None, 0)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("exact_only", [False, True])
def test_a_hit_canary_re_registered_or_discarded_is_reported_as_it_is_now(
    minter: CanaryMinter, core: str, exact_only: bool
) -> None:
    canary = minter.mint(0, 4, 0)
    index = CanaryIndex(minter)
    index.add(canary, ALICE)

    def owners() -> list[Owner | None]:
        with using(core):
            scanner = index.scanner(exact_only=exact_only)
            return [hit.owner for hit in scanner.feed(f"say {canary}.") + scanner.finish()]

    assert owners() == [ALICE]  # the first hit decodes and records the canary
    index.add(canary, BOB)
    assert owners() == [BOB]
    index.discard(canary)
    assert owners() == [None]  # not live: attributed (its origin decodes), no owner

"""Partial and disguised leaks: 5-word fragments of a foreign canary are attributed findings."""

from __future__ import annotations

from detector_factories import make_obs, make_plan
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canaries import TAG, CanaryIndex, CanaryMinter, Owner
from kvcanary.canaries.fragments import MAX_RESPONSE_CHARS
from kvcanary.harness.detectors import ContentDetector
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.run.wiring import MAX_RESPONSE_BYTES
from kvcanary.tenants.plan import RequestPlan

SEPARATORS = [
    " ",
    "\n",
    "-",
    "_",
    "\u00a0",  # no-break space
    "\u2014",  # em dash
    "\u200b",  # zero-width space
    "\u2060",  # word joiner
    "\u00ad",  # soft hyphen
    "\ufeff",  # zero-width no-break space
    "\u200c",  # zero-width non-joiner
    "\u0120",  # byte-level BPE space
    "\u010a",  # byte-level BPE newline
    "\u2581",  # SentencePiece space
]

MINTER = CanaryMinter.from_seed(11, "fragments")
INDEX = CanaryIndex(MINTER)
VICTIM = Owner("tenant-1", "t1-r000004")
CANARIES = MINTER.mint_many(1, 4, range(8))
INDEX.add_many((canary, VICTIM) for canary in CANARIES)
READER_CANARIES = MINTER.mint_many(0, 9, range(8))
INDEX.add_many((canary, Owner("tenant-0", "t0-r000009")) for canary in READER_CANARIES)
READER: RequestPlan = make_plan("t0-r000009", tenant="tenant-0")


def scan(text: str, chunk: int) -> list[Finding]:
    response = ContentDetector(INDEX).start(READER)
    findings: list[Finding] = []
    for start in range(0, len(text), chunk):
        findings += response.feed(text[start : start + chunk])
    return findings + response.finish(make_obs(READER, text=text))


@settings(max_examples=300, deadline=None)
@given(
    canary=st.sampled_from(CANARIES),
    first=st.integers(0, 1),
    gaps=st.lists(st.sampled_from(SEPARATORS), min_size=5, max_size=5),
    tagged=st.booleans(),
    upper=st.booleans(),
    before=st.sampled_from(["", "Sure. ", "As quoted:\n", "«", "x" * 200 + " "]),
    after=st.sampled_from(["", ".", " and more", "\u200b\u200b."]),
    chunk=st.sampled_from([1, 2, 7, 64, 1 << 16]),
)
def test_five_word_windows_with_any_separators_are_attributed(
    canary: str,
    first: int,
    gaps: list[str],
    tagged: bool,
    upper: bool,
    before: str,
    after: str,
    chunk: int,
) -> None:
    words = canary.split()[1 + first : 6 + first]
    shown = words[0] + "".join(gap + word for gap, word in zip(gaps[1:], words[1:], strict=True))
    if tagged:
        shown = TAG + gaps[0] + shown
    if upper:
        shown = shown.upper()
    [finding] = scan(before + shown + after, chunk)
    assert finding.kind is FindingKind.CROSS_TENANT_CANARY
    assert (finding.victim_tenant, finding.victim_request_id) == (VICTIM.tenant, VICTIM.request_id)
    assert finding.marker == canary
    assert finding.details["layer"] == "fragment"


def test_a_foreign_fragment_after_a_stray_tag_names_its_owner() -> None:
    words = CANARIES[3].split()[1:]
    [finding] = scan(f"see ydk settle {' '.join(words)} ok", 1)
    assert finding.kind is FindingKind.CROSS_TENANT_CANARY
    assert finding.victim_request_id == VICTIM.request_id


def test_four_words_are_not_a_fragment() -> None:
    words = CANARIES[2].split()[1:]
    for separator in SEPARATORS:
        assert scan("quote: " + separator.join(words[:4]) + ".", 5) == []


def test_the_bound_covers_the_harness_response_limit() -> None:
    assert MAX_RESPONSE_BYTES <= MAX_RESPONSE_CHARS

"""The content detector on synthetic streamed responses laced with real canaries."""

from __future__ import annotations

import dataclasses
import random

import pytest
from detector_factories import make_obs, make_plan

from kvcanary.canaries import CanaryIndex, CanaryMinter, Owner
from kvcanary.canaries.index import SCAN_BLOCK
from kvcanary.canaries.span import CanarySpan
from kvcanary.harness.detectors import ContentDetector, ResponseScan
from kvcanary.harness.record.finding import Finding, FindingKind, Severity
from kvcanary.tenants.plan import RequestPlan

SECRET = "the other customer's quarterly revenue is 4.2 million"


class Run:
    """A run's minter and index, with canaries minted and registered per request."""

    def __init__(self, seed: int = 1) -> None:
        self.minter = CanaryMinter.from_seed(seed, "run")
        self.index = CanaryIndex(self.minter)
        self.canaries: dict[str, list[str]] = {}

    def plan(self, tenant: int, request: int, num_canaries: int = 4) -> RequestPlan:
        request_id = f"t{tenant}-r{request:06d}"
        canaries = self.minter.mint_many(tenant, request, range(num_canaries))
        for canary in canaries:
            self.index.add(canary, Owner(f"tenant-{tenant}", request_id))
        self.canaries[request_id] = canaries
        return make_plan(request_id, tenant=f"tenant-{tenant}")


def stream(scan: ResponseScan, chunks: list[str]) -> list[Finding]:
    """Feed every chunk, then finish; all findings in the order they came."""
    findings = []
    for chunk in chunks:
        findings += scan.feed(chunk)
    return findings + scan.finish(make_obs(scan.plan, text="".join(chunks)))


def split(text: str, num_chunks: int, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), num_chunks - 1))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.fixture
def run() -> Run:
    return Run()


def test_other_tenants_canary_is_a_critical_cross_tenant_finding(run: Run) -> None:
    victim = run.plan(0, 3)
    reader = run.plan(2, 17)
    canary = run.canaries[victim.request_id][1]
    text = f"Sure. {SECRET} {canary} and more."
    [finding] = stream(ContentDetector(run.index).start(reader), [text])
    assert finding.kind is FindingKind.CROSS_TENANT_CANARY
    assert finding.severity is Severity.CRITICAL
    assert (finding.tenant, finding.request_id) == ("tenant-2", "t2-r000017")
    assert (finding.victim_tenant, finding.victim_request_id) == ("tenant-0", "t0-r000003")
    start = text.index(canary)
    assert finding.offsets == (start, start + len(canary))
    assert finding.marker == canary
    assert finding.summary == (
        "tenant-2's response to t2-r000017 contained tenant-0's canary from request "
        f"t0-r000003 (exact match at chars {start}-{start + len(canary)}): "
        "a leak from another tenant"
    )
    assert finding.details["layer"] == "exact"
    assert finding.details["relation"] == "other_tenant"
    assert finding.details["num_markers"] == 1


@pytest.mark.parametrize("num_chunks", [2, 3, 5, 17, 0])
def test_a_canary_split_across_chunks_is_found_once(run: Run, num_chunks: int) -> None:
    """0 chunks means one chunk per character, with empty chunks in between."""
    victim = run.plan(0, 1)
    reader = run.plan(1, 2)
    canary = run.canaries[victim.request_id][0]
    text = f"xx {canary} yy"
    rng = random.Random(num_chunks)
    for _ in range(20):
        scan = ContentDetector(run.index).start(reader)
        if num_chunks:
            chunks = split(text, num_chunks, rng)
        else:
            chunks = [piece for char in text for piece in (char, "")]
        [finding] = stream(scan, chunks)
        assert finding.offsets == (3, 3 + len(canary))
        assert len(scan.hits) == 1


def test_findings_arrive_while_streaming(run: Run) -> None:
    victim = run.plan(0, 1)
    reader = run.plan(1, 2)
    canary = run.canaries[victim.request_id][0]
    scan = ContentDetector(run.index).start(reader)
    assert scan.feed(f"{canary} ") == []
    live = scan.feed("filler " * (2 * SCAN_BLOCK // 7))  # enough text for the scanner to decide
    assert [f.kind for f in live] == [FindingKind.CROSS_TENANT_CANARY]
    assert scan.finish(make_obs(reader)) == []


def test_own_canaries_are_echoes_not_findings(run: Run) -> None:
    plan = run.plan(0, 5)
    text = "You said: " + " ".join(run.canaries[plan.request_id]) + ". Noted."
    scan = ContentDetector(run.index).start(plan)
    assert stream(scan, [text]) == []
    assert len(scan.hits) == 4  # still reported for redaction


def test_same_tenants_other_request_is_cross_request(run: Run) -> None:
    earlier = run.plan(1, 4)
    plan = run.plan(1, 9)
    text = "prefix " + run.canaries[earlier.request_id][2]
    [finding] = stream(ContentDetector(run.index).start(plan), [text])
    assert finding.kind is FindingKind.CROSS_REQUEST_CANARY
    assert finding.severity is Severity.HIGH
    assert (finding.victim_tenant, finding.victim_request_id) == ("tenant-1", "t1-r000004")
    assert "its own other request t1-r000004" in finding.summary
    assert finding.summary.endswith(": a leak from another request of the same tenant")


def test_canary_of_another_run_is_unknown(run: Run) -> None:
    plan = run.plan(0, 1)
    stranger = CanaryMinter.from_seed(99, "someone-else").mint(0, 1, 0)
    [finding] = stream(ContentDetector(run.index).start(plan), [f"a {stranger} b"])
    assert finding.kind is FindingKind.UNKNOWN_CANARY
    assert finding.severity is Severity.MEDIUM
    assert finding.victim_tenant is None
    assert finding.details["origin"] is None
    assert "never minted" in finding.summary
    assert finding.summary.endswith(": a leak of unknown origin")


def test_one_finding_per_foreign_owner_request_with_a_marker_count(run: Run) -> None:
    a, b, c = run.plan(0, 1, 40), run.plan(0, 2), run.plan(3, 1)
    plan = run.plan(1, 1)
    leaked = run.canaries[a.request_id] + run.canaries[b.request_id][:3]
    leaked += run.canaries[c.request_id][:2] + run.canaries[plan.request_id]
    rng = random.Random(0)
    rng.shuffle(leaked)
    scan = ContentDetector(run.index).start(plan)
    findings = stream(scan, [" filler ".join(leaked)])
    counts = {f.victim_request_id: f.details["num_markers"] for f in findings}
    assert counts == {"t0-r000001": 40, "t0-r000002": 3, "t3-r000001": 2}
    assert {f.kind for f in findings} == {FindingKind.CROSS_TENANT_CANARY}
    assert len(scan.hits) == 40 + 3 + 2 + 4


def test_excerpt_shows_canaries_and_hides_everything_else(run: Run) -> None:
    victim = run.plan(0, 1)
    plan = run.plan(2, 2)
    canary = run.canaries[victim.request_id][0]
    text = f"{SECRET}. {canary} {SECRET} " * 3
    [finding] = stream(ContentDetector(run.index).start(plan), [text])
    excerpt = finding.excerpt
    assert excerpt is not None
    assert canary in excerpt
    assert "chars redacted, sha256:" in excerpt
    rest = excerpt.replace(canary, " ")  # what is shown besides the canary itself
    for word in set(SECRET.split()) | {"quarterly", "revenue", "million"}:
        assert word not in rest
    assert excerpt.startswith("[… ")
    assert excerpt.endswith(" …]")


def test_unredacted_excerpt_when_asked(run: Run) -> None:
    victim = run.plan(0, 1)
    plan = run.plan(2, 2)
    canary = run.canaries[victim.request_id][0]
    text = f"{SECRET} {SECRET} {canary}"
    [finding] = stream(ContentDetector(run.index, redact_excerpts=False).start(plan), [text])
    assert finding.excerpt == text[-(64 + len(canary)) :]  # 64 chars of context each side


def test_disguised_and_fragmentary_canaries_are_found(run: Run) -> None:
    victim = run.plan(0, 1)
    plan = run.plan(1, 1)
    first, second = run.canaries[victim.request_id][:2]
    disguised = first.upper().replace(" ", "-")
    fragment = " ".join(second.split()[1:])
    findings = stream(ContentDetector(run.index).start(plan), [f"{disguised} .. {fragment}"])
    [finding] = findings
    assert finding.details["layer"] == "normalized"
    assert finding.details["matched_text"] == disguised
    assert finding.details["num_markers"] == 2


def test_scan_text_reanalyses_a_recorded_response(run: Run) -> None:
    victim = run.plan(0, 1)
    plan = run.plan(1, 1)
    obs = make_obs(plan, text="x " + run.canaries[victim.request_id][0])
    [finding] = ContentDetector(run.index).scan_text(plan, obs)
    assert finding.kind is FindingKind.CROSS_TENANT_CANARY


def _with_spans(plan: RequestPlan, canaries: list[str]) -> RequestPlan:
    spans = tuple(CanarySpan(c, 0, 0, i) for i, c in enumerate(canaries))
    return dataclasses.replace(plan, canaries=spans)


def test_a_splice_of_two_own_canaries_is_an_echo(run: Run) -> None:
    """Quoted excerpts can join one own canary's head to another's tail: no finding."""
    plan = run.plan(0, 7)
    first, second = run.canaries[plan.request_id][:2]
    head, tail = first.split()[:3], second.split()[3:]  # tag + 2 words | last 4 words
    splice = " ".join(head + tail)
    assert run.minter.attribute(splice) is None  # canary-shaped, decoded by no key
    scan = ContentDetector(run.index).start(_with_spans(plan, run.canaries[plan.request_id]))
    assert stream(scan, [f"quoted: {splice} and more"]) == []


def test_a_foreign_run_canary_is_not_mistaken_for_a_splice(run: Run) -> None:
    plan = run.plan(0, 8)
    stranger = CanaryMinter.from_seed(99, "someone-else").mint(0, 1, 0)
    scan = ContentDetector(run.index).start(_with_spans(plan, run.canaries[plan.request_id]))
    [finding] = stream(scan, [f"a {stranger} b"])
    assert finding.kind is FindingKind.UNKNOWN_CANARY


def test_content_kinds_say_which_leak_they_are() -> None:
    assert {kind: kind.leak for kind in FindingKind if kind.leak is not None} == {
        FindingKind.CROSS_TENANT_CANARY: "a leak from another tenant",
        FindingKind.CROSS_REQUEST_CANARY: "a leak from another request of the same tenant",
        FindingKind.UNKNOWN_CANARY: "a leak of unknown origin",
    }
    assert FindingKind.UNSAFE_ACCEPT.leak is None


def test_each_finding_names_the_field_its_marker_came_from(run: Run) -> None:
    victim, other = run.plan(0, 1), run.plan(3, 2)
    plan = run.plan(1, 1)
    scan = ContentDetector(run.index).start(plan)
    first, second = run.canaries[victim.request_id][0], run.canaries[other.request_id][0]
    findings = scan.feed("Thinking. ", "reasoning") + scan.feed("Answer: ")
    findings += scan.feed('{"q": "' + first[:20], "tool_calls[0].function.arguments")
    findings += scan.feed(first[20:] + '"}', "tool_calls[0].function.arguments")
    findings += scan.feed(f" and {second}.")
    findings += scan.finish(make_obs(plan))
    fields = {f.victim_request_id: f.details["field"] for f in findings}
    assert fields == {"t0-r000001": "tool_calls[0].function.arguments", "t3-r000002": "content"}
    by_request = {f.victim_request_id: f.summary for f in findings}
    assert "in `tool_calls[0].function.arguments`)" in by_request["t0-r000001"]
    assert "in `" not in by_request["t3-r000002"]

"""The content detector: canaries in a response that do not belong to the request.

Every prompt is laced with canaries attributable to (run, tenant, request). A response may
quote its own prompt's canaries (an echo, expected and harmless); any other canary in it came
from somewhere it should not have. Each hit the streaming scanner reports (`canaries`) is
classified against the request that received the response:

| relation | finding | severity |
|---|---|---|
| own request | none (an echo) | - |
| same tenant, other request | `cross_request_canary` | high |
| other tenant | `cross_tenant_canary` | critical |
| canary-shaped, not minted by this run | `unknown_canary` | medium |

**Aggregation.** One finding per (response, foreign owner request): a leaked page holds
many canaries of its owner, and one finding saying so is more useful than a hundred. The
finding carries the *first* marker from that owner (marker, offsets, layer) and
`details["num_markers"]`, the number of that owner's markers seen in the response when the
finding fired. Findings fire as soon as the scanner reports the marker (the runner shows
them live; the scanner decides in blocks of tens of kilobytes, so for an ordinary response
that is at `finish()`, with every count complete), and markers arriving later do not change
a finding already returned; the final per-owner counts are in
`ResponseScan.num_markers_by_owner`. Unknown-origin markers have no owner: all of a
response's unknown markers are one finding.

**Splices are echoes.** A response that quotes its prompt in excerpts (the reference
engine quotes whole pages; a real model may skip words) can join the head of one of its own
canaries (tag and first words) to the tail of another: canary-shaped, yet no key decodes it.
A canary-shaped hit that splits into the tag plus a prefix of one of the request's *own*
canaries and a suffix of one of its own canaries is an own-request echo, not an unknown
canary. Only the request's own canaries are consulted, so a marker from another run still
needs its first and last words to match this prompt's canaries at the same split to be
missed (probability about num_canaries^2 * 2^-70 per split with 6 words).

**Redaction.** The response text around a foreign canary may be another customer's data.
Excerpts are a window of `context_chars` on each side of the first marker, passed through
`canaries.redact`: canary spans stay readable, every other run of text becomes a
`[… N chars redacted, sha256:… …]` marker, so a person sees which canaries appeared and can
match hashes against evidence without the text itself. `redact_excerpts=False` keeps the raw
window (for the bundled engine, whose text is all synthetic).

It deliberately knows nothing about timing, status codes or usage (timing and protocol
detectors), and does not mint or index canaries (the `canaries` package).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

from canaries import CanaryIndex, Hit, Relation, StreamScanner, classify, redact
from harness.record.finding import Finding, FindingKind
from harness.record.observation import Observation
from tenants.plan import RequestPlan

DETECTOR = "content"

_KIND_OF: dict[Relation, FindingKind] = {
    Relation.OTHER_TENANT: FindingKind.CROSS_TENANT_CANARY,
    Relation.SAME_TENANT: FindingKind.CROSS_REQUEST_CANARY,
    Relation.UNKNOWN: FindingKind.UNKNOWN_CANARY,
}

_WORD = re.compile(r"[a-z]+")

OwnerKey = tuple[str, str | None, str | None]
"""(relation, owner tenant, owner request id): one finding per key per response."""


class ContentDetector:
    """Scans responses for foreign canaries; one `ResponseScan` per response."""

    def __init__(
        self, index: CanaryIndex, *, context_chars: int = 64, redact_excerpts: bool = True
    ) -> None:
        assert context_chars >= 0
        self.index = index
        self.context_chars = context_chars
        self.redact_excerpts = redact_excerpts

    def start(self, plan: RequestPlan) -> ResponseScan:
        """Begin scanning the response to `plan`; feed it every chunk, then finish it."""
        return ResponseScan(self, plan, self.index.scanner())

    def scan_text(self, plan: RequestPlan, obs: Observation) -> list[Finding]:
        """Scan a whole recorded response at once (re-analysis of a journal)."""
        scan = self.start(plan)
        findings = scan.feed(obs.text)
        return findings + scan.finish(obs)


@dataclass(slots=True)
class _OwnerTally:
    first: Hit
    num_markers: int = 0


class ResponseScan:
    """The content detector's view of one streaming response."""

    def __init__(
        self, detector: ContentDetector, plan: RequestPlan, scanner: StreamScanner
    ) -> None:
        self.detector = detector
        self.plan = plan
        self.hits: list[Hit] = []
        """Every hit so far, own-request echoes included (for redacting the stored text)."""
        self._scanner = scanner
        self._chunks: list[str] = []
        self._tallies: dict[OwnerKey, _OwnerTally] = {}
        self._finished = False
        self._own_parts: tuple[set[tuple[str, ...]], set[tuple[str, ...]]] | None = None

    @property
    def num_markers_by_owner(self) -> dict[OwnerKey, int]:
        """Foreign markers per (relation, owner tenant, owner request), counted so far."""
        return {key: tally.num_markers for key, tally in self._tallies.items()}

    def feed(self, chunk: str) -> list[Finding]:
        """Scan one streamed chunk; returns findings for foreign owners seen for the first time."""
        assert not self._finished, "feed() after finish()"
        if chunk:
            self._chunks.append(chunk)
        return self._take(self._scanner.feed(chunk))

    def finish(self, observation: Observation) -> list[Finding]:
        """Flush the scanner's tail (a marker at the very end) and close the scan."""
        assert observation.request_id == self.plan.request_id, "observation of another request"
        assert not self._finished, "finish() called twice"
        findings = self._take(self._scanner.finish())
        self._finished = True
        return findings

    def _take(self, hits: list[Hit]) -> list[Finding]:
        self.hits.extend(hits)
        new_keys: list[OwnerKey] = []
        for hit in hits:
            relation = classify(hit, tenant=self.plan.tenant, request_id=self.plan.request_id)
            if relation is Relation.OWN or (
                relation is Relation.UNKNOWN and hit.origin is None and self._is_own_splice(hit)
            ):
                continue
            owner = hit.owner
            key: OwnerKey = (
                relation.value,
                None if owner is None else owner.tenant,
                None if owner is None else owner.request_id,
            )
            tally = self._tallies.get(key)
            if tally is None:
                tally = self._tallies[key] = _OwnerTally(first=hit)
                new_keys.append(key)
            tally.num_markers += 1
        return [self._finding(key, Relation(key[0])) for key in new_keys]

    def _is_own_splice(self, hit: Hit) -> bool:
        """Whether `hit` is the head of one own canary joined to the tail of another."""
        words = _WORD.findall(hit.text.lower())
        if self._own_parts is None:
            self._own_parts = _prefixes_and_suffixes(c.text for c in self.plan.canaries)
        prefixes, suffixes = self._own_parts
        body = tuple(words[1:])  # words[0] is the tag
        return any(body[:cut] in prefixes and body[cut:] in suffixes for cut in range(1, len(body)))

    def _finding(self, key: OwnerKey, relation: Relation) -> Finding:
        tally = self._tallies[key]
        hit = tally.first
        kind = _KIND_OF[relation]
        _, victim_tenant, victim_request = key
        plan = self.plan
        where = f"{hit.layer} match at chars {hit.start}-{hit.end}"
        if relation is Relation.OTHER_TENANT:
            what = f"{victim_tenant}'s canary from request {victim_request}"
        elif relation is Relation.SAME_TENANT:
            what = f"a canary from its own other request {victim_request}"
        elif hit.origin is not None:  # this run's key decodes it, but no owner is known
            what = (
                f"a canary of this run (tenant #{hit.origin.tenant}, request "
                f"#{hit.origin.request}) whose owner is not in the index"
            )
        else:
            what = "a canary-shaped marker this run never minted"
        summary = f"{plan.tenant}'s response to {plan.request_id} contained {what} ({where})"
        return Finding(
            kind=kind,
            severity=kind.severity,
            detector=DETECTOR,
            request_id=plan.request_id,
            tenant=plan.tenant,
            summary=summary,
            victim_tenant=victim_tenant,
            victim_request_id=victim_request,
            marker=hit.canary if hit.canary is not None else hit.text,
            offsets=(hit.start, hit.end),
            excerpt=self._excerpt(hit),
            details={
                "relation": relation.value,
                "layer": hit.layer,
                "matched_text": hit.text,
                "num_markers": tally.num_markers,
                "owner_tenant": victim_tenant,
                "owner_request_id": victim_request,
                "origin": _origin_record(hit),
                "phase": plan.phase,
                "intent": plan.intent,
                "num_prompt_tokens": plan.num_prompt_tokens,
                "redacted": self.detector.redact_excerpts,
            },
        )

    def _excerpt(self, hit: Hit) -> str:
        """A window around `hit`, foreign text replaced by its length and hash."""
        text = "".join(self._chunks)
        self._chunks = [text]  # keep the join for the next excerpt
        width = self.detector.context_chars
        lo, hi = max(0, hit.start - width), min(len(text), hit.end + width)
        inside = [h for h in self.hits if h.start < hi and h.end > lo]
        # Never cut a canary in half at the window's edge.
        lo = min([lo, *(h.start for h in inside)])
        hi = max([hi, *(h.end for h in inside)])
        window = text[lo:hi]
        if not self.detector.redact_excerpts:
            return window
        shifted = [dataclasses.replace(h, start=h.start - lo, end=h.end - lo) for h in inside]
        return redact(window, shifted)


def _origin_record(hit: Hit) -> dict[str, int] | None:
    return None if hit.origin is None else dataclasses.asdict(hit.origin)


def _prefixes_and_suffixes(
    canaries: Iterable[str],
) -> tuple[set[tuple[str, ...]], set[tuple[str, ...]]]:
    """Every proper word prefix and suffix (tag excluded) of the given canaries."""
    prefixes: set[tuple[str, ...]] = set()
    suffixes: set[tuple[str, ...]] = set()
    for canary in canaries:
        body = tuple(_WORD.findall(canary.lower())[1:])
        for cut in range(1, len(body)):
            prefixes.add(body[:cut])
            suffixes.add(body[cut:])
    return prefixes, suffixes

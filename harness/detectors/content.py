"""The content detector: canaries in a response that do not belong to the request.

Every prompt is laced with canaries attributable to (run, tenant, request). A response may
quote its own prompt's canaries (an echo, expected and harmless); any other canary in it came
from somewhere it should not have. Each hit the streaming scanner reports (`canaries`) is
classified against the request that received the response:

| relation | finding | severity |
|---|---|---|
| own request, or recombined from its own prompt | none (an echo; `own_echo`) | - |
| same tenant, other request | `cross_request_canary`: a leak | high |
| other tenant | `cross_tenant_canary`: a leak | critical |
| canary-shaped, not minted, no own echo | `unknown_canary`: leak of unknown origin | medium |

An `unknown_canary` that an earlier run's key decodes (`earlier_runs`, from `--keyring`) is
named in its summary and `details["earlier_run"]`: run, tenant, request and age.

Each finding names the response field its first marker starts in (`feed(chunk, field)`).

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

**Recombined echoes.** A response that quotes its prompt imperfectly (the reference engine
quotes page-sized excerpts; a real model asked to repeat the text skips, reorders and splices
pieces at token boundaries) can join words of its own canaries and filler into a
canary-shaped marker that no key decodes. A marker of unknown origin whose words can all be
read as a recombination of the request's *own* prompt text is an echo (`own_echo`, counted in
`ResponseScan.own_echoes` and journaled by the runner as an `OwnEchoRecorded` event), never a
finding. "Recombination" is as loose as a budget allows: the chance that a canary of another
run (whose words are uniform on the word list, independent of this prompt) passes as an echo
must stay at or below `ECHO_HIDE_BOUND` (1e-3 per marker). For a prompt with u distinct list
words that is reached by any order, any mixture ((u/B)^w <= 1e-3: prompts up to about 2,200
tokens); for longer prompts the marker must split into at most `max_pieces` contiguous runs
of the prompt's words, the largest count that keeps the union bound over splits below the
budget (e.g. 5 for 4,096-token prompts, 3 for 1M-token ones). One word (not the tag) may
come from no part of this prompt (a dropped token glues two pieces of prompt words into a
new list word) under a budget of its own: any order while w (u/B)^(w-1) <= 1e-3 (prompts up
to about 1,100 tokens), else a bounded number of pieces, the substituted word one of them
(`harness.detectors.own_echo`). A marker with two or more words from outside this prompt,
or made of words from no prompt of this run, is always `unknown_canary`. Only markers no
key decodes and no live canary's fragment overlaps reach this rule: a canary of this run,
or another live canary's fragment, is attributed first.

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
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Protocol

from kvcanary.canaries import CanaryIndex, Hit, Relation, StreamScanner, classify, redact
from kvcanary.harness.detectors.own_echo import OwnText
from kvcanary.harness.record.events import OwnEchoRecorded
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.record.observation import Observation
from kvcanary.tenants.plan import RequestPlan

DETECTOR = "content"

_KIND_OF: dict[Relation, FindingKind] = {
    Relation.OTHER_TENANT: FindingKind.CROSS_TENANT_CANARY,
    Relation.SAME_TENANT: FindingKind.CROSS_REQUEST_CANARY,
    Relation.UNKNOWN: FindingKind.UNKNOWN_CANARY,
}

DEFAULT_FIELD = "content"
"""The field a chunk belongs to when the caller does not say (completions' `text` too)."""

MAX_ECHO_MARKERS = 8
"""Own-echo markers journaled per response (their words are all the request's own)."""


class EarlierRuns(Protocol):
    """Earlier runs' keys (`harness.run.keyring.EarlierRuns`, with `--keyring`)."""

    def explain(self, canary: str) -> tuple[str, dict[str, Any]] | None:
        """Whose canary from which earlier run, in words and as a record; None if none."""
        ...


OwnerKey = tuple[str, str | None, str | None]
"""(relation, owner tenant, owner request id): one finding per key per response."""


class ContentDetector:
    """Scans responses for foreign canaries; one `ResponseScan` per response."""

    def __init__(
        self,
        index: CanaryIndex,
        *,
        context_chars: int = 64,
        redact_excerpts: bool = True,
        earlier_runs: EarlierRuns | None = None,
    ) -> None:
        assert context_chars >= 0
        self.index = index
        self.context_chars = context_chars
        self.redact_excerpts = redact_excerpts
        self.earlier_runs = earlier_runs

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
        self.own_echoes: list[Hit] = []
        """Canary-shaped markers recombined from the request's own prompt: echoes, no finding."""
        self._own_text: OwnText | None = None
        self._num_chars = 0
        self._field_starts: list[int] = []  # response offsets where a new field begins
        self._field_names: list[str] = []

    @property
    def num_markers_by_owner(self) -> dict[OwnerKey, int]:
        """Foreign markers per (relation, owner tenant, owner request), counted so far."""
        return {key: tally.num_markers for key, tally in self._tallies.items()}

    def feed(self, chunk: str, field: str = DEFAULT_FIELD) -> list[Finding]:
        """Scan one streamed chunk of the response field `field` (`content`, `reasoning`,
        `tool_calls[0].function.arguments`, ...); returns findings for foreign owners seen
        for the first time, each naming the field its first marker starts in."""
        assert not self._finished, "feed() after finish()"
        if chunk:
            if not self._field_names or self._field_names[-1] != field:
                self._field_starts.append(self._num_chars)
                self._field_names.append(field)
            self._chunks.append(chunk)
            self._num_chars += len(chunk)
        return self._take(self._scanner.feed(chunk))

    def field_of(self, hit: Hit) -> str:
        """The response field in which `hit` starts."""
        at = bisect_right(self._field_starts, hit.start) - 1
        return self._field_names[at] if at >= 0 else DEFAULT_FIELD

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
            if relation is Relation.OWN:
                continue
            if relation is Relation.UNKNOWN and self._is_own_echo(hit):
                self.own_echoes.append(hit)
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

    def _is_own_echo(self, hit: Hit) -> bool:
        """Whether an unknown-origin `hit` is a recombination of the request's own prompt."""
        if hit.origin is not None or hit.canary is None:
            return False
        if self._own_text is None:
            self._own_text = OwnText(self.plan.prompt, self.plan.canaries)
        return self._own_text.explains(hit.canary.split())

    def own_echo_event(self, t_wall: float) -> OwnEchoRecorded | None:
        """The journal event for this response's own echoes (after `finish`), or None."""
        if not self.own_echoes:
            return None
        markers = tuple(h.canary or h.text for h in self.own_echoes[:MAX_ECHO_MARKERS])
        return OwnEchoRecorded(
            request_id=self.plan.request_id,
            tenant=self.plan.tenant,
            num_markers=len(self.own_echoes),
            markers=markers,
            t_wall=t_wall,
        )

    def _finding(self, key: OwnerKey, relation: Relation) -> Finding:
        tally = self._tallies[key]
        hit = tally.first
        kind = _KIND_OF[relation]
        _, victim_tenant, victim_request = key
        plan = self.plan
        field = self.field_of(hit)
        where = f"{hit.layer} match at chars {hit.start}-{hit.end}"
        earlier = self._earlier_run(hit) if relation is Relation.UNKNOWN else None
        if field != DEFAULT_FIELD:
            where += f", in `{field}`"
        if relation is Relation.OTHER_TENANT:
            what = f"{victim_tenant}'s canary from request {victim_request}"
        elif relation is Relation.SAME_TENANT:
            what = f"a canary from its own other request {victim_request}"
        elif hit.origin is not None:  # this run's key decodes it, but no owner is known
            what = (
                f"a canary of this run (tenant #{hit.origin.tenant}, request "
                f"#{hit.origin.request}) whose owner is not in the index"
            )
        elif earlier is not None:
            what = f"{earlier[0]}, minted by an earlier run (found by --keyring)"
        else:
            what = (
                "a canary-shaped marker this run never minted, which the request's own prompt "
                "does not explain"
            )
        summary = (
            f"{plan.tenant}'s response to {plan.request_id} contained {what} ({where}): {kind.leak}"
        )
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
                "field": field,
                "matched_text": hit.text,
                "num_markers": tally.num_markers,
                "owner_tenant": victim_tenant,
                "owner_request_id": victim_request,
                "origin": _origin_record(hit),
                "earlier_run": earlier[1] if earlier is not None else None,
                "phase": plan.phase,
                "intent": plan.intent,
                "num_prompt_tokens": plan.num_prompt_tokens,
                "redacted": self.detector.redact_excerpts,
            },
        )

    def _earlier_run(self, hit: Hit) -> tuple[str, dict[str, Any]] | None:
        """An earlier run's attribution of a marker this run's key does not decode."""
        earlier_runs = self.detector.earlier_runs
        if earlier_runs is None or hit.origin is not None or hit.canary is None:
            return None
        return earlier_runs.explain(hit.canary)

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

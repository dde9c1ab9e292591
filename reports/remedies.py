"""What to do about each finding kind: the remedies, with the upstream work that carries them.

`REMEDIES` is the one table, keyed by finding kind (every kind has an entry). A run's
`summary.json` lists, under `what_to_do`, an entry for each kind it found (most severe
first): the problem in one sentence and the remedies, most effective first, each with its
references; `report.html` and `report.md` render that list. The references are the ones the
project knows (`reference_engine.config.FIXES` models each engine fix; the shared notes on
SGLang's PD code give their state): SGLang's admission fixes (#36988, #38935, merged
2026-09-10) and length-coverage check (#38704, open), the KV checksum
(`--disaggregation-enable-kv-checksum`, #39500), deferred KV release (#35049), and for the
prefix cache vLLM's `cache_salt` (#17045) and the credential-derived salt (PR #53347).

An `unknown_canary` is often not another run's canary but this run's own, quoted imperfectly:
a model (or a stale page) joins words of canaries it saw into a canary-shaped marker no key
decodes. The content detector calls such a marker an echo only while chance cannot explain
it (`harness.detectors.content`); past that budget it stays a finding. `spliced` tells them
apart in a report: a marker that shares at least half its words with the canaries quoted
next to it in the same response is a splice of those canaries (a canary of another run
shares three of six words with them by chance about once in 10^5 markers).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
from markupsafe import Markup, escape

from kvcanary.canaries.shape import CANARY_PATTERN
from kvcanary.harness.record.finding import FindingKind, Severity

_SGLANG = "https://github.com/sgl-project/sglang"
_VLLM = "https://github.com/vllm-project/vllm"


@dataclass(frozen=True, slots=True)
class Reference:
    """Upstream work a remedy points at."""

    label: str
    url: str


def _sglang(number: int, what: str) -> Reference:
    return Reference(f"SGLang #{number} ({what})", f"{_SGLANG}/pull/{number}")


ADMISSION = (_sglang(38935, "merged"), _sglang(36988, "merged"), _sglang(38704, "open"))
CHECKSUM = _sglang(39500, "--disaggregation-enable-kv-checksum")
DEFERRED_RELEASE = _sglang(35049, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE")
INCIDENT = Reference("SGLang #30233 (the incident)", f"{_SGLANG}/issues/30233")
SALT = Reference("vLLM #17045 (cache_salt)", f"{_VLLM}/pull/17045")
DERIVED_SALT = Reference("vLLM PR #53347 (salt derived from the credential)", f"{_VLLM}/pull/53347")


@dataclass(frozen=True, slots=True)
class Remedy:
    """One thing to do, as a sentence, and where upstream it is done."""

    action: str
    references: tuple[Reference, ...] = ()


@dataclass(frozen=True, slots=True)
class Advice:
    """What a finding kind says is wrong with the deployment, and what to do, best first."""

    problem: str
    remedies: tuple[Remedy, ...]
    note: str = ""
    """What else a person should know to read the finding right."""


REJECT_OVER_POOL = Remedy(
    "Reject a prompt longer than the smallest KV pool (or the context) with an error before "
    "any KV is allocated or transferred: SGLang v0.5.22 or later, with the admission fixes "
    "(check that your build has #38935).",
    ADMISSION,
)
POOLS_HOLD_CONTEXT = Remedy(
    "Size the prefill and the decode KV pool to hold at least one context-length request "
    "each, or lower the advertised context to what the smallest pool holds; "
    "`kvcanary audit --target URL` reads both pools and the context from the running engine.",
)
KV_CHECKSUM = Remedy(
    "Turn on `--disaggregation-enable-kv-checksum` on prefill and on decode (one side alone "
    "checks nothing: decode skips the comparison when prefill sent no checksum).",
    (CHECKSUM,),
)
HOLD_ABORTED_PAGES = Remedy(
    "Hold an aborted request's decode pages until prefill's in-flight KV write has drained "
    "(deferred release); a leak after client disconnects is this race.",
    (DEFERRED_RELEASE,),
)
SALT_FROM_CREDENTIAL = Remedy(
    "Give each tenant its own prefix-cache salt, set by the gateway from the tenant's "
    "credential (never taken from the request body: a client-sent `cache_salt` is a bearer "
    "secret), or turn prefix caching off across tenants.",
    (SALT, DERIVED_SALT),
)
_PAGE_REUSE = (REJECT_OVER_POOL, POOLS_HOLD_CONTEXT, KV_CHECKSUM, HOLD_ABORTED_PAGES)

REMEDIES: dict[FindingKind, Advice] = {
    FindingKind.CROSS_TENANT_CANARY: Advice(
        "One tenant's response quoted another tenant's prompt: KV pages were read by a "
        "request they were not written for.",
        _PAGE_REUSE,
        "Treat it as a data leak: the evidence/ files name both requests.",
    ),
    FindingKind.CROSS_REQUEST_CANARY: Advice(
        "A response quoted another request of the same tenant: KV pages outlived their "
        "request, which across tenants is a leak.",
        _PAGE_REUSE,
    ),
    FindingKind.UNKNOWN_CANARY: Advice(
        "A response held a canary-shaped marker that no key of this run decodes.",
        (
            Remedy(
                "Compare the marker with the canaries quoted around it in the excerpt (grey): "
                "if half or more of its words are theirs, it is this run's own canaries "
                "spliced together by the model, an imperfect echo, not another run's canary."
            ),
            Remedy(
                "Run with `--keyring FILE`, so that a later run names the run, tenant and "
                "request of a canary an earlier run minted."
            ),
            Remedy(
                "A marker that is no splice is another run's canary: treat it as a "
                "cross-tenant leak whose owner is unknown; the remedies for "
                "`cross_tenant_canary` apply.",
                (*ADMISSION, CHECKSUM),
            ),
        ),
        "Often it is this run's own canary: a model asked to repeat text splices words of "
        "the canaries it saw into a new canary-shaped marker. kvcanary counts a splice of "
        "the request's own prompt as an echo (no finding) only while chance cannot explain "
        "it; one with two or more words from outside the prompt stays a finding.",
    ),
    FindingKind.UNSAFE_ACCEPT: Advice(
        "A prompt above the KV pool or the context got a success status instead of an "
        "error: the path of the incident, where decode runs over pages prefill never wrote.",
        (REJECT_OVER_POOL, POOLS_HOLD_CONTEXT, KV_CHECKSUM),
        "SGLang's routers relay decode's status and usage, so the client sees a normal 200.",
    ),
    FindingKind.FAST_PREFILL: Advice(
        "An answer came faster than a prefill of its prompt can run: the prompt was not "
        "prefilled, and the answer was computed over pages written for something else.",
        (REJECT_OVER_POOL, KV_CHECKSUM, POOLS_HOLD_CONTEXT),
        "Every prompt starts with a request-unique canary, so no honest prefix-cache hit "
        "explains it; a response cache in front of the engine would, so test without one.",
    ),
    FindingKind.PROMPT_TOKENS_MISMATCH: Advice(
        "`usage.prompt_tokens` disagrees with the tokens sent: a count of 1 is prefill's "
        "placeholder for a rejected prompt (the incident's mark); other counts mean the "
        "target tokenizes differently.",
        (
            REJECT_OVER_POOL,
            Remedy(
                "For other counts, count with the target's tokenizer (`--tokenizer server`, "
                "or its tokenizer.json) and check what the gateway adds to the prompt.",
                (INCIDENT,),
            ),
        ),
    ),
    FindingKind.SHARED_PREFIX_CACHE: Advice(
        "One tenant's prompt prefix was served from another tenant's prefix cache: the "
        "timing of a cache hit lets a tenant read out another tenant's prompts.",
        (SALT_FROM_CREDENTIAL,),
        "SGLang builds that drop the body's salt (#23300) share the cache whatever it says.",
    ),
    FindingKind.POOL_SMALLER_THAN_CONTEXT: Advice(
        "A KV pool cannot hold the context length the target advertises: the "
        "misconfiguration behind the incident.",
        (POOLS_HOLD_CONTEXT, REJECT_OVER_POOL),
        "vLLM refuses to start such pools; SGLang lowers its own input limit below the "
        "advertised context, which a router in front does not enforce.",
    ),
    FindingKind.ERROR_IN_SUCCESS: Advice(
        "A 2xx response carried an error: clients and monitoring count a failure as a success.",
        (
            Remedy(
                "Make the router or gateway return the engine's error status instead of "
                "relaying a 200 whose body or SSE stream holds the error."
            ),
        ),
    ),
    FindingKind.CACHE_SALT_NOT_BOUND: Advice(
        "A tenant sending another tenant's `cache_salt` was served from that tenant's "
        "cache: the salt is a bearer secret, not bound to the credential.",
        (SALT_FROM_CREDENTIAL,),
    ),
}
assert REMEDIES.keys() == set(FindingKind), "every finding kind says what to do"

_SEVERITY_RANK = {severity: rank for rank, severity in enumerate(Severity)}


def what_to_do(findings: pd.DataFrame) -> list[dict[str, Any]]:
    """`summary.json`'s `what_to_do`: for each kind found, most severe first, the problem,
    the remedies and their references (`unknown_canary` also counts its splices)."""
    counts = findings["kind"].astype(str).value_counts()
    found = [kind for kind in FindingKind if counts.get(str(kind), 0)]
    found.sort(key=lambda kind: _SEVERITY_RANK[kind.severity])
    entries = []
    for kind in found:
        advice = REMEDIES[kind]
        entry: dict[str, Any] = {
            "kind": str(kind),
            "num_findings": int(counts[str(kind)]),
            "problem": advice.problem,
            "remedies": [
                {"action": r.action, "references": [_reference_record(ref) for ref in r.references]}
                for r in advice.remedies
            ],
            "note": advice.note,
        }
        if kind is FindingKind.UNKNOWN_CANARY:
            entry["spliced"] = spliced_markers(findings)
        entries.append(entry)
    return entries


def _reference_record(reference: Reference) -> dict[str, str]:
    return {"label": reference.label, "url": reference.url}


def spliced(marker: str, excerpt: str) -> bool:
    """Whether `marker` shares at least half its words with the other canaries in `excerpt`
    (the canaries a response quoted around it: a splice of them, not another run's)."""
    words = marker.lower().split()[1:]
    near: set[str] = set()
    for match in CANARY_PATTERN.finditer(excerpt.lower()):
        if match.group(1).split() != words:
            near.update(match.group(1).split())
    return bool(words) and 2 * sum(word in near for word in words) >= len(words)


def spliced_markers(findings: pd.DataFrame) -> dict[str, Any]:
    """How many `unknown_canary` findings are splices of the canaries next to them, and the
    first few of their requests."""
    unknown = findings.loc[findings["kind"].astype(str) == str(FindingKind.UNKNOWN_CANARY)]
    requests = [
        str(row.request_id)
        for row in unknown.itertuples(index=False)
        if isinstance(row.marker, str)
        and isinstance(row.excerpt, str)
        and spliced(row.marker, row.excerpt)
    ]
    return {"num_spliced": len(requests), "of": len(unknown), "requests": requests[:5]}


def remedy_list(entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The remedies of `what_to_do` entries, each once, in the order they first appear (most
    severe kind first, best remedy first), with the kinds it answers (`kinds`)."""
    merged: dict[str, dict[str, Any]] = {}
    for entry in entries:
        for remedy in entry["remedies"]:
            item = merged.setdefault(remedy["action"], {**remedy, "kinds": []})
            item["kinds"].append(entry["kind"])
    return list(merged.values())


def markdown_lines(summary: Mapping[str, Any]) -> list[str]:
    """`report.md`'s "What to do" section (nothing when nothing was found)."""
    entries = summary.get("what_to_do") or []
    if not entries:
        return []
    lines = ["### What to do", ""]
    for entry in entries:
        note = f" *{_md(entry['note'])}*" if entry.get("note") else ""
        lines.append(
            f"- `{entry['kind']}` ({entry['num_findings']}): {_md(entry['problem'])}{note}"
        )
        if "spliced" in entry:
            lines.append(f"  {_md(splice_sentence(entry['spliced']))}")
    lines.append("")
    for number, remedy in enumerate(remedy_list(entries), start=1):
        links = ", ".join(f"[{_md(r['label'])}]({r['url']})" for r in remedy["references"])
        kinds = ", ".join(f"`{kind}`" for kind in remedy["kinds"])
        lines.append(
            f"{number}. {_md(remedy['action'])}"
            + (f" ({links})" if links else "")
            + f" For {kinds}."
        )
    return [*lines, ""]


def splice_sentence(spliced: dict[str, Any]) -> str:
    """`unknown_canary`'s splice count, as the reports say it."""
    num, total = spliced["num_spliced"], spliced["of"]
    if not num:
        return (
            f"None of the {total} unknown marker finding(s) is a splice of the canaries next to it."
        )
    where = ", ".join(spliced["requests"])
    return (
        f"{num} of {total} unknown marker finding(s) share half or more of their words with "
        f"the canaries next to them (this run's own canaries, spliced), e.g. in {where}."
    )


def code_spans(text: str) -> Markup:
    """`text` as HTML: escaped, its `backticked` spans in `<code>` (for report.html)."""
    pieces = str(escape(text)).split("`")
    return Markup(
        "".join(f"<code>{piece}</code>" if i % 2 else piece for i, piece in enumerate(pieces))
    )


def _md(text: str) -> str:
    """Text for a Markdown list item: HTML-escaped (a CI step summary renders HTML)."""
    return html.escape(text, quote=False)

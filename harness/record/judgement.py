"""The verdict table applied: a run's findings and what it could not judge -> its verdict.

One rule for every report, headline and exit status (`judge`), from the rows of
`harness.record.finding.KIND_RULES`:

- `leak`: evidence that one tenant's data reached another: a finding whose kind is a leak
  on its own (a foreign canary, a prefix cache shared across tenants), or two findings on
  one request that are a leak together (an over-limit prompt accepted *and* answered faster
  than a prefill: the incident's signature);
- `unsafe`: protocol defects without evidence of a leak: any other finding;
- `inconclusive`: what was planned could not be judged (the reasons come from the caller,
  which knows what was planned); a finding of a kind that is not `decisive` (an error
  inside a 2xx) does not outweigh it;
- `clean`: nothing found, and nothing left unjudged.

`verdict_table_text` and `verdict_table_markdown` render the same table for `--help` and the
docs, so what a user reads is what the code applies.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvcanary.harness.record.finding import KIND_RULES, KindRule, Severity
from kvcanary.harness.record.verdict import Verdict

FindingFact = tuple[str, str | None]
"""What the rule needs of a finding: its kind and its request id (None: run-level)."""

_UNKNOWN_KIND = KindRule(Severity.HIGH, Verdict.UNSAFE, "a finding kind this version does not know")
"""A kind from a newer kvcanary's journal: a finding all the same, never silently clean."""


@dataclass(frozen=True, slots=True)
class Judgement:
    """A verdict and, for a person, why."""

    verdict: Verdict
    reasons: tuple[str, ...]


def rule_of(kind: str) -> KindRule:
    """The table's row for `kind` (a kind it does not know counts as `unsafe`)."""
    return _RULES_BY_NAME.get(str(kind), _UNKNOWN_KIND)


_RULES_BY_NAME = {str(kind): rule for kind, rule in KIND_RULES.items()}


def judge(
    findings: Iterable[FindingFact],
    not_judged: Sequence[str] = (),
    *,
    remarks: Sequence[str] = (),
    clean_reason: str = "no finding",
) -> Judgement:
    """The verdict of a run with these findings, given why parts of it could not be judged.

    `remarks` are said beside findings (e.g. that the target stopped serving for a while);
    `clean_reason` is the reason a clean verdict gives.
    """
    counts: Counter[str] = Counter()
    requests: dict[str, set[str]] = {}
    for kind, request_id in findings:
        counts[str(kind)] += 1
        if request_id is not None:
            requests.setdefault(str(kind), set()).add(request_id)
    if not counts and not_judged:
        return Judgement(Verdict.INCONCLUSIVE, tuple(not_judged))
    if not counts:
        return Judgement(Verdict.CLEAN, (clean_reason,))
    found = findings_reason(counts)
    paired = _paired_requests(requests)
    if paired or any(rule_of(kind).verdict is Verdict.LEAK for kind in counts):
        why = [found, *([_pair_reason(paired)] if paired else [])]
        return Judgement(Verdict.LEAK, (*why, *remarks))
    if any(rule_of(kind).decisive for kind in counts) or not not_judged:
        return Judgement(Verdict.UNSAFE, (f"{found} {_UNSAFE_NOTE}", *remarks))
    return Judgement(Verdict.INCONCLUSIVE, (*not_judged, f"{found} {_UNSAFE_NOTE}"))


_UNSAFE_NOTE = "(protocol defects; no evidence that one tenant's data reached another)"


def findings_reason(counts: Counter[str]) -> str:
    """`3 finding(s): 2 cross_tenant_canary (a leak from another tenant), 1 unsafe_accept`."""
    kinds = ", ".join(
        f"{num} {kind}" + (f" ({rule_of(kind).origin})" if rule_of(kind).origin else "")
        for kind, num in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    )
    return f"{counts.total()} finding(s): {kinds}"


def _paired_requests(requests: dict[str, set[str]]) -> set[str]:
    """Requests with two findings that are a leak together (`KindRule.leak_with`)."""
    paired: set[str] = set()
    for kind, rule in KIND_RULES.items():
        if rule.leak_with is not None:
            paired |= requests.get(str(kind), set()) & requests.get(str(rule.leak_with), set())
    return paired


def _pair_reason(paired: set[str]) -> str:
    return (
        f"{len(paired)} request(s) accepted above a limit and answered faster than a prefill "
        "(the incident's signature)"
    )


def verdict_rows() -> list[tuple[Verdict, str]]:
    """Each verdict with when it is given, in the table's order (from `KIND_RULES`)."""
    leaks = [str(k) for k, rule in KIND_RULES.items() if rule.verdict is Verdict.LEAK]
    pairs = [
        f"{kind} and {rule.leak_with} on the same request"
        for kind, rule in KIND_RULES.items()
        if rule.leak_with is not None and str(kind) < str(rule.leak_with)
    ]
    unsafe = [str(k) for k, rule in KIND_RULES.items() if rule.verdict is Verdict.UNSAFE]
    weak = [str(k) for k, rule in KIND_RULES.items() if not rule.decisive]
    return [
        (
            Verdict.LEAK,
            "evidence that one tenant's data reached another: a finding of "
            f"{_either(leaks)}; or {_either(pairs)} (an over-limit prompt accepted and "
            "answered faster than a prefill: the incident's signature)",
        ),
        (
            Verdict.UNSAFE,
            f"protocol defects without evidence of a leak: any finding of {_either(unsafe)}",
        ),
        (
            Verdict.INCONCLUSIVE,
            "what was planned could not be judged: the target stopped answering, the run "
            "ended before its over-limit prompts were answered, no victim request was "
            f"accepted, or a probe could not reach a decision (a finding of {_either(weak)} "
            "alone does not outweigh this)",
        ),
        (Verdict.CLEAN, "everything planned was sent and judged, and nothing was found"),
    ]


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def verdict_table_text(width: int = 88) -> str:
    """The verdict table as plain text (for `--help`: print it with a raw formatter)."""
    lines = ["Verdicts (exit status):"]
    for verdict, when in verdict_rows():
        lines += _hanging(f"  {verdict:<13} {verdict.exit_status}  ", when, width)
    lines += ["", "Findings (kind, severity, verdict on its own):"]
    for kind, rule in KIND_RULES.items():
        note = f"; {rule.leak_with} on the same request makes it a leak" if rule.leak_with else ""
        head = f"  {kind:<26} {rule.severity:<9} {rule.verdict:<7} "
        lines += _hanging(head, rule.meaning + note, width)
    return "\n".join(lines)


def _hanging(head: str, text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, initial_indent=head, subsequent_indent=" " * len(head)) or [
        head.rstrip()
    ]


def verdict_table_markdown() -> str:
    """The verdict table as Markdown (the docs' reference page is generated from it)."""
    lines = ["| verdict | when | exit |", "|---|---|---|"]
    lines += [f"| `{v}` | {when} | {v.exit_status} |" for v, when in verdict_rows()]
    lines += ["", "| finding kind | severity | verdict | meaning |", "|---|---|---|---|"]
    for kind, rule in KIND_RULES.items():
        note = f". With `{rule.leak_with}` on the same request: `leak`" if rule.leak_with else ""
        meaning = rule.meaning.replace("|", "\\|") + note
        lines.append(f"| `{kind}` | {rule.severity} | `{rule.verdict}` | {meaning} |")
    return "\n".join(lines) + "\n"

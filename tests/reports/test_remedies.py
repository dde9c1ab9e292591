"""What to do: every finding kind has remedies, a run's summary lists those of the kinds it
found (most severe first), report.md and report.html render each remedy once, and a spliced
own canary is told apart from another run's."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvcanary.canaries.shape import TAG, WORDS
from kvcanary.harness.record.finding import FindingKind
from kvcanary.reports.remedies import (
    REMEDIES,
    code_spans,
    markdown_lines,
    remedy_list,
    spliced,
    what_to_do,
)
from kvcanary.reports.render import RenderResult


def canary(*words: str) -> str:
    return " ".join((TAG, *words))


OWN = canary(*WORDS[100:106])
OTHER = canary(*WORDS[200:206])


def test_every_finding_kind_says_what_to_do() -> None:
    assert set(REMEDIES) == set(FindingKind)
    for kind, advice in REMEDIES.items():
        assert advice.problem.endswith("."), kind
        assert advice.remedies, kind
        for remedy in advice.remedies:
            assert remedy.action.endswith("."), (kind, remedy.action)
            for reference in remedy.references:
                assert reference.url.startswith("https://github.com/"), reference


def test_the_incidents_remedies_name_the_upstream_fixes() -> None:
    actions = " ".join(r.action for r in REMEDIES[FindingKind.UNSAFE_ACCEPT].remedies)
    labels = {
        ref.label for r in REMEDIES[FindingKind.UNSAFE_ACCEPT].remedies for ref in r.references
    }
    assert "SGLang v0.5.22 or later" in actions
    assert "kvcanary audit --target URL" in actions
    assert "--disaggregation-enable-kv-checksum" in actions
    assert {"SGLang #38935 (merged)", "SGLang #38704 (open)"} <= labels
    salts = " ".join(r.action for r in REMEDIES[FindingKind.CACHE_SALT_NOT_BOUND].remedies)
    assert "set by the gateway from the tenant's credential" in salts
    leak = {
        ref.label
        for r in REMEDIES[FindingKind.CROSS_TENANT_CANARY].remedies
        for ref in r.references
    }
    assert any(label.startswith("SGLang #35049") for label in leak)  # deferred release


@pytest.mark.parametrize(
    ("marker", "excerpt", "expected"),
    [
        # three of its six words are the own canary's, quoted next to it: a splice
        (canary(*WORDS[100:103], *WORDS[300:303]), f"{OWN} and ", True),
        # words of two canaries nearby, mixed
        (canary(*WORDS[100:102], *WORDS[200:202], *WORDS[300:302]), f"{OWN} {OTHER} ", True),
        # two of six: another run's canary that shares a little by chance
        (canary(*WORDS[100:102], *WORDS[300:304]), f"{OWN} ", False),
        # the marker repeated is not a neighbour of its own
        (canary(*WORDS[300:306]), f"{canary(*WORDS[300:306])} ", False),
    ],
)
def test_a_marker_made_of_the_canaries_next_to_it_is_a_splice(
    marker: str, excerpt: str, expected: bool
) -> None:
    assert spliced(marker, f"[… 12 chars redacted …] {excerpt}{marker} [… 3 …]") is expected


def test_the_summary_lists_what_to_do_for_the_kinds_found_most_severe_first(
    rendered: dict[str, RenderResult],
) -> None:
    summary = json.loads(rendered["vulnerable"].paths["json"].read_text())
    entries = summary["what_to_do"]
    assert [e["kind"] for e in entries] == [
        "cross_tenant_canary", "unsafe_accept", "fast_prefill", "prompt_tokens_mismatch"
    ]  # fmt: skip
    assert all(e["num_findings"] == 1 for e in entries)
    first = entries[0]["remedies"][0]
    assert first["action"].startswith("Reject a prompt longer than the smallest KV pool")
    assert first["references"][0] == {
        "label": "SGLang #38935 (merged)",
        "url": "https://github.com/sgl-project/sglang/pull/38935",
    }
    clean = json.loads(rendered["clean"].paths["json"].read_text())
    assert clean["what_to_do"] == []


def test_unknown_canaries_count_their_splices() -> None:
    findings = pd.DataFrame(
        {
            "kind": ["unknown_canary", "unknown_canary", "unsafe_accept"],
            "severity": ["medium", "medium", "critical"],
            "request_id": ["r-1", "r-2", "r-3"],
            "marker": [canary(*WORDS[100:104], *WORDS[400:402]), OTHER, None],
            "excerpt": [f"{OWN} {canary(*WORDS[100:104], *WORDS[400:402])}", OTHER, None],
        }
    )
    entries = what_to_do(findings)
    assert [e["kind"] for e in entries] == ["unsafe_accept", "unknown_canary"]
    assert entries[1]["spliced"] == {"num_spliced": 1, "of": 2, "requests": ["r-1"]}
    assert "this run's own canary" in entries[1]["note"]


def test_report_md_gives_each_remedy_once_with_the_kinds_it_answers(
    rendered: dict[str, RenderResult],
) -> None:
    text = rendered["vulnerable"].paths["md"].read_text()
    section = text[text.index("### What to do") : text.index("### Findings")]
    assert section.count("Reject a prompt longer than the smallest KV pool") == 1
    assert (
        "For `cross_tenant_canary`, `unsafe_accept`, `fast_prefill`, `prompt_tokens_mismatch`."
        in section
    )
    assert "[SGLang #38935 (merged)](https://github.com/sgl-project/sglang/pull/38935)" in section
    assert "### What to do" not in rendered["clean"].paths["md"].read_text()


def test_remedies_are_merged_in_the_order_they_first_appear() -> None:
    entries = what_to_do(pd.DataFrame({"kind": ["fast_prefill", "cache_salt_not_bound"]}))
    merged = remedy_list(entries)
    assert [item["kinds"] for item in merged][:1] == [["fast_prefill"]]
    assert merged[-1]["kinds"] == ["cache_salt_not_bound"]
    assert len(merged) == len({item["action"] for item in merged})
    assert markdown_lines({"what_to_do": []}) == []


def test_html_text_is_escaped_and_backticks_become_code() -> None:
    assert str(code_spans("run `kvcanary audit` <now> & `x`")) == (
        "run <code>kvcanary audit</code> &lt;now&gt; &amp; <code>x</code>"
    )


def test_report_html_has_the_section(rendered: dict[str, RenderResult]) -> None:
    page = rendered["vulnerable"].paths["html"].read_text()
    assert '<section id="what-to-do">' in page
    assert "https://github.com/sgl-project/sglang/pull/39500</span>" in page  # as text
    assert 'id="what-to-do"' not in rendered["clean"].paths["html"].read_text()

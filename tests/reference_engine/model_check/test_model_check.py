"""The PD handoff model (reference_engine/model_check): spin finds the placeholder (#30233) and
the mid-transfer abort (#35049) counterexamples in the vulnerable model, each fix closes what
it should, all fixes leave none within the bound, and the table in docs/how-to/verify.md is
this one.

Needs Debian's `spin` and gcc (docs/how-to/verify.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvcanary.reference_engine.model_check import runner
from kvcanary.reference_engine.model_check.runner import MODEL_FIXES, Row
from kvcanary.reference_engine.model_check.trail import Step, parse_steps, render

pytestmark = pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None,
    reason="model checking needs spin and gcc on PATH (apt-get install spin gcc)",
)

VERIFY_PAGE = Path(__file__).resolve().parents[3] / "docs" / "how-to" / "verify.md"

EXPECTED = {  # row: (#30233 placeholder, #35049 mid-transfer abort)
    "vulnerable": ("leak", "leak"),
    "admission_retire": (None, "leak"),
    "coverage_check": (None, "leak"),
    "kv_checksum": (None, "leak"),
    "page_tags": (None, None),  # decode checks every tag before it stamps its next page
    "zero_on_free": ("unwritten read", "leak"),
    "deferred_release": ("leak", None),
    "pool_covers_context": (None, "leak"),
    "all fixes": (None, None),
}


@pytest.fixture(scope="module")
def table() -> list[Row]:
    return runner.table()


def test_each_fix_closes_what_it_should_and_all_fixes_leave_nothing(table: list[Row]) -> None:
    found = {
        row.label: (row.cells["placeholder"].violation, row.cells["abort"].violation)
        for row in table
    }
    assert found == EXPECTED
    everything = table[-1].cells["any"]  # any size, either client may drop, every fix on
    assert everything.fixes == frozenset(MODEL_FIXES)
    assert everything.violation is None
    assert everything.num_states > 100_000  # a real search, not a model that stopped at once
    assert not any(c.bound_reached for row in table for c in row.cells.values())


def test_the_readme_shows_this_table(table: list[Row]) -> None:
    lines = runner.format_table(table)
    readme = VERIFY_PAGE.read_text()
    assert "\n".join(f"  {line}" for line in lines) in readme  # as `kvcanary verify` prints it
    assert runner.bound_text() in readme


def test_the_placeholder_counterexample_reads_a_victims_page(table: list[Row]) -> None:
    result = table[0].cells["placeholder"]
    texts = [step.text for step in result.steps]
    assert any("one-token placeholder" in text for text in texts)
    reader = result.steps[-1]
    assert reader.text.startswith("decode reads page")
    assert reader.reads_from is not None
    assert reader.reads_from != reader.request
    assert "prefill concludes Success (1 pages sent)" in _of(result.steps, reader.request)
    rendered = render(result.steps, result.violation)
    assert rendered[-1] == "     => violated: leak"
    assert "(holds request" in rendered[-2]


def test_the_abort_counterexample_is_a_late_write_after_the_pages_were_reused(
    table: list[Row],
) -> None:
    steps = table[0].cells["abort"].steps
    reader = steps[-1]
    victim = reader.reads_from
    assert victim is not None
    assert victim != reader.request
    texts = [(s.request, s.text) for s in steps]
    dropped = texts.index((victim, "client drops the request"))
    posted = next(i for i, (r, t) in enumerate(texts) if r == victim and "posts its write" in t)
    landed = next(i for i, (r, t) in enumerate(texts) if r == victim and "write lands" in t)
    committed = texts.index((reader.request, f"decode commits (room {reader.request} checked)"))
    assert posted < dropped < landed  # the write was in flight when the client dropped
    assert committed < landed  # and landed in the pages the next request already committed


def test_deferred_release_with_a_timeout_reopens_the_abort_race() -> None:
    result = runner.check({"deferred_release"}, "abort", prop=1, release_timeout=True)
    assert result.violation == "leak"
    assert any("no drain ack before the timeout" in s.text for s in result.steps)


def test_parse_steps_keeps_only_the_models_step_lines() -> None:
    replay = (
        "      @1 decode reads page 0 (holds KV of 1)\n"
        " 12:\tproc  5 (Decode:1) m.pml:94 (state 131)\t[printf('@%d ...')]\n"
        "                  @0 prefill concludes Success (1 pages sent)\n"
    )
    steps = list(parse_steps(replay))
    assert steps == [
        Step(1, "decode reads page 0 (holds KV of 1)"),
        Step(0, "prefill concludes Success (1 pages sent)"),
    ]
    assert steps[0].reads_from == 0
    assert steps[0].describe() == "request 1: decode reads page 0 (holds request 0's KV)"


def _of(steps: tuple[Step, ...], request: int) -> list[str]:
    return [step.text for step in steps if step.request == request]


@pytest.mark.parametrize(
    ("original", "mutant", "violation"),
    [
        (  # decode forgets to free a finished request's pages
            '  atomic { free_pages(r); printf("@%d decode frees its pages\\n", r) }\ndone:',
            "  skip;\ndone:",
            "page lost",
        ),
        (  # prefill never concludes a failed room: a deferred-release decode waits forever
            '  atomic { status[r] = FAILED; printf("@%d prefill concludes Failed\\n", r) };',
            "  skip;",
            "request never ends",
        ),
        (  # decode's allocator hands out a page whether or not it is free
            ":: owner[p] == NOBODY -> break",
            ":: true -> break",
            "page owned by two requests",
        ),
    ],
)
def test_the_other_properties_catch_a_broken_model(
    tmp_path: Path, original: str, mutant: str, violation: str
) -> None:
    text = runner.MODEL.read_text()
    assert text.count(original) == 1
    broken = tmp_path / "mutant.pml"
    broken.write_text(text.replace(original, mutant))
    fixes = {"deferred_release", "admission_retire"}
    assert runner.check(fixes, "abort", model=broken).violation == violation
    assert runner.check(fixes, "abort").violation is None  # the real model holds

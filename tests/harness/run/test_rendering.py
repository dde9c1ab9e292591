"""The render of a run's reports: here for a short run, in a child process for a long one
(and for every soak): the run's own memory never holds the render's frames."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.events import Limits, RunFinished, RunStarted
from kvcanary.harness.record.journal import JournalWriter
from kvcanary.harness.record.verdict import Verdict
from kvcanary.harness.run import rendering
from kvcanary.harness.run.progress import ProgressDisplay


def _journal(run_dir: Path) -> Path:
    """A run that sent nothing: its verdict is inconclusive, whoever renders it."""
    run_dir.mkdir()
    writer = JournalWriter(run_dir / "journal.jsonl")
    limits = Limits(384, 768, 16, "flags")
    writer.write(
        RunStarted("run", "http://target", "m", "completions", limits, (), 1, "k", t_wall=1.0)
    )
    writer.write(RunFinished("completed", 2.0, 0))
    writer.close()
    return run_dir


def _display() -> ProgressDisplay:
    return ProgressDisplay(num_requests=1, file=io.StringIO(), live=False)


def _not_here(out_dir: Path, keep_raw_evidence: bool) -> rendering.Rendered:
    raise AssertionError("rendered in the run's own process")


def test_a_journal_over_the_bound_is_rendered_in_a_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = _journal(tmp_path / "run")
    monkeypatch.setattr(rendering, "APART_ABOVE_BYTES", 0)
    monkeypatch.setattr(rendering, "render_here", _not_here)

    rendered = rendering.render(run_dir, keep_raw_evidence=False, display=_display())

    assert rendered.verdict is Verdict.INCONCLUSIVE
    assert rendered.errors == {}
    assert set(rendered.paths) >= {"json", "md", "junit", "html"}
    assert json.loads(rendered.paths["json"].read_text()) == rendered.summary
    assert rendered.summary["verdict"] == "inconclusive"


def test_a_short_run_is_rendered_here_and_a_soak_always_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = _journal(tmp_path / "run")
    here = rendering.render(run_dir, keep_raw_evidence=False, display=_display())
    monkeypatch.setattr(rendering, "render_here", _not_here)
    with pytest.raises(AssertionError, match="own process"):
        rendering.render(run_dir, keep_raw_evidence=False, display=_display())
    apart = rendering.render(run_dir, keep_raw_evidence=False, display=_display(), apart=True)
    assert (apart.verdict, apart.summary) == (here.verdict, here.summary)


def test_a_child_that_finds_no_journal_says_so_as_the_render_here_would(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no journal in"):
        rendering.render(tmp_path, keep_raw_evidence=False, display=_display(), apart=True)

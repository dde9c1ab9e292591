"""`kvcanary report`: exit status by verdict, one-line usage errors, light imports."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcanary.harness.cli import main


@pytest.mark.parametrize(
    ("scenario", "status", "verdict"),
    [("clean", 0, "clean"), ("vulnerable", 1, "leak"), ("interrupted", 3, "inconclusive")],
)
def test_exit_status_follows_the_verdict(
    record: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
    scenario: str,
    status: int,
    verdict: str,
) -> None:
    run_dir = record(scenario)
    assert main(["report", str(run_dir), "--format", "json,md"]) == status
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"verdict: {verdict.upper()}")
    assert lines[1:] == [
        f"  markdown  {run_dir / 'report.md'}",
        f"  summary   {run_dir / 'summary.json'}",
        f"  evidence  {run_dir / 'evidence'}",
        f"  journal   {run_dir / 'journal.jsonl'}",
    ]
    assert not (run_dir / "report.html").exists()


def test_report_and_run_end_with_the_same_verdict_block(
    record: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcanary.harness.commands.run import print_verdict
    from kvcanary.reports.render import render_run

    run_dir = record("interrupted")
    assert main(["report", str(run_dir)]) == 3
    report_out = capsys.readouterr().out
    result = render_run(run_dir)
    print_verdict(
        str(result.verdict), result.summary["verdict_reasons"], "interrupted", result.paths, run_dir
    )
    assert capsys.readouterr().out == report_out
    assert report_out.startswith("verdict: INCONCLUSIVE - the run ended before the probe phase")
    assert "(run interrupted)" in report_out.splitlines()[0]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{missing}"], "is not a directory"),
        (["{empty}"], "no journal"),
        (["{run}", "--format", "html,pdf"], "unknown report format pdf"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    record: Callable[[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    arguments: list[str],
    message: str,
) -> None:
    places = {"missing": tmp_path / "nope", "empty": tmp_path, "run": record("clean")}
    assert main(["report", *(a.format(**places) for a in arguments)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_a_broken_output_is_reported_and_not_clean(
    record: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcanary.reports import render

    def broken(*args: object) -> bytes:
        raise OSError("disk full")

    monkeypatch.setattr(render, "render_junit", broken)
    assert main(["report", str(record("clean"))]) == 3
    assert "junit failed: OSError: disk full" in capsys.readouterr().err


def test_the_command_module_imports_no_pandas_or_matplotlib() -> None:
    code = (
        "import sys, reports.command;"
        "heavy = {'pandas', 'matplotlib', 'pyarrow', 'jinja2'} & set(sys.modules);"
        "print(sorted(heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_hostile_journal_is_read_with_one_line_per_skipped_record(
    record: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Nesting deeper than the stack, a number no int64 holds, a schema of the wrong type:
    each record is skipped with one line (said once, though the journal is read twice)."""
    run_dir = record("vulnerable")
    journal = run_dir / "journal.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    first_observation = next(i for i, line in enumerate(lines) if b'"observation"' in line)
    lines[first_observation] = lines[first_observation].replace(
        b'"status":200', b'"status":1' + b"0" * 40
    )
    lines[0] = lines[0].replace(b'"schema":1', b'"schema":"2"')
    lines.insert(2, b"[" * 100_000 + b"\n")
    journal.write_bytes(b"".join(lines))
    assert main(["report", str(run_dir), "--format", "json,md,junit"]) == 1  # still a leak
    err = capsys.readouterr().err
    assert "Traceback" not in err
    said = [line for line in err.splitlines() if line.startswith("kvcanary: report: warning: ")]
    assert len(said) == 3, err
    assert "journal.jsonl:1: skipped a 'run_started' record" in said[0]
    assert "run_started.schema: expected int, got a string" in said[0]
    assert "journal.jsonl:3: skipped a corrupt line" in said[1]
    assert "observation.status: integer out of range" in said[2]

"""A soak stopped before its final render leaves no out-of-date report looking current."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from misbehaving_server import serve
from test_cli_run import LIMIT_FLAGS, fake_target

from kvcanary.harness.cli import main
from kvcanary.harness.record.journal import JournalWriter

pytestmark = pytest.mark.slow


def test_a_soak_stopped_by_a_full_disk_sets_its_periodic_report_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills some requests after a periodic report: the report (which counts fewer
    requests than the journal holds) must not stay in place as if it were the run's."""
    out = tmp_path / "soak"
    real_write = JournalWriter.write
    num_after_report = 0

    def write(self: JournalWriter, event: Any, line: bytes | None = None) -> None:
        nonlocal num_after_report
        if (out / "summary.json").exists():
            num_after_report += 1
            if num_after_report > 20:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, event, line)

    monkeypatch.setattr(JournalWriter, "write", write)
    argv = ["soak", *LIMIT_FLAGS, "--duration", "10m", "--report-every", "1s"]
    with serve(fake_target(delay_s=0.01)) as url:
        status = main([*argv, "--concurrency", "1", "--target", url, "--out", str(out)])

    err = capsys.readouterr().err
    assert status == 3
    assert "No space left on device" in err
    assert "Traceback" not in err
    for name in ("summary.json", "report.html", "report.md", "junit.xml"):
        assert not (out / name).exists(), name
        assert (out / f"{name}.stale").exists(), name
    assert "last periodic report is out of date" in err
    assert f"run `kvcanary report {out}` for current ones" in err
    stale = json.loads((out / "summary.json.stale").read_text())
    num_plans = (out / "journal.jsonl").read_text().count('"type":"plan"')
    assert stale["counts"]["requests"]["total"] < num_plans  # what made it stale

"""An `--out` that cannot be written is refused in one line before the target is contacted,
even where `os.access` says yes (root on a read-only mount or a pseudo filesystem)."""

from __future__ import annotations

from pathlib import Path

import pytest
from recorded_targets import RecordedTarget, serving

from kvcanary.harness.cli import main


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_an_out_on_a_pseudo_filesystem_is_refused_before_anything_is_sent(
    capfd: pytest.CaptureFixture[str],
) -> None:
    target = RecordedTarget({})
    out = "/proc/kvcanary-unwritable-run"
    with serving(target) as url:
        status = main(["run", "--target", url, "--model", "m", "--out", out])
    err = capfd.readouterr().err
    assert status == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"kvcanary: error: --out {out}: /proc is not writable"), err
    assert "Traceback" not in err
    assert target.seen == []

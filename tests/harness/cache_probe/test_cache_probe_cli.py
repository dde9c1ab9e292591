"""`kvcanary run --cache-probe`: the opt-in probe phase, its findings and its journal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcanary.harness.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.timing
def test_the_probe_phase_finds_the_bundled_engines_shared_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["run", "--requests", "2", "--tenants", "2", "--profile", "below", "--seed", "3"]
    argv += ["--engine-prefix-cache", "--cache-probe", "--cache-probe-trials", "10"]
    status = main([*argv, "--out", str(out)])

    printed = capsys.readouterr()
    assert status == 1
    assert "starting the bundled reference engine (vulnerable, prefix cache on)" in printed.err
    assert "cache probe: LEAK: tenant-1 re-sending tenant-0's prefix" in printed.err
    records = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    phases = [r["phase"] for r in records if r["type"] == "phase"]
    assert phases[-1] == "cache_probe"
    (finished,) = [r for r in records if r["type"] == "probe_finished"]
    assert finished["verdict"] == "leak"
    assert finished["details"]["design"]["num_trials"] == 10
    found = [r for r in records if r["type"] == "finding" and r["kind"] == "shared_prefix_cache"]
    assert {(f["victim_tenant"], f["tenant"]) for f in found} == {
        ("tenant-0", "tenant-1"),
        ("tenant-1", "tenant-0"),
    }
    assert all(f["details"]["contrast"]["p_adjusted"] < 1e-3 for f in found)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["findings"]["shared_prefix_cache"] == 2
    assert [p["probe"] for p in summary["probes"]] == ["cache_probe"]
    assert summary["probes"][0]["verdict"] == "leak"
    assert "shared_prefix_cache" not in summary["checks_not_run"]  # the probe ran and found it


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--target", "http://127.0.0.1:9", "--engine-prefix-cache"], "apply only without"),
        (["--cache-probe", "--cache-probe-trials", "3"], "at least 5"),
    ],
)
def test_unusable_probe_settings_are_usage_errors(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *flags, "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err

"""`kvcanary verify`: the table for one fix combination, trails, exit statuses, and a
generated scenario that parses and, for the placeholder counterexample, reproduces with
`kvcanary repro` against the bundled engine (README.md, "Model-checking the PD handoff").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvcanary.harness.cli import main
from kvcanary.harness.scenarios.schema import parse_scenario
from kvcanary.reference_engine.model_check import runner
from kvcanary.reference_engine.model_check.scenario import to_scenario

pytestmark = pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None,
    reason="model checking needs spin and gcc on PATH (apt-get install spin gcc)",
)


def test_verify_one_fix_prints_its_row_trails_and_writes_its_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "scenarios"
    argv = ["verify", "--fix", "deferred_release", "--trails", "--scenarios", str(out)]
    assert main(argv) == 1  # the placeholder is still there
    stdout = capsys.readouterr().out
    assert f"bound: {runner.bound_text()}" in stdout
    row = next(line for line in stdout.splitlines() if line.startswith("  deferred_release"))
    assert row.split() == ["deferred_release", "leak", "-"]
    assert "deferred_release, #30233 placeholder: leak" in stdout
    assert "one-token placeholder" in stdout
    written = sorted(out.iterdir())
    assert [p.name for p in written] == ["model-placeholder-deferred-release.toml"]
    scenario = parse_scenario(written[0].read_text(), str(written[0]))
    assert scenario.engine is not None
    assert scenario.engine.fixes == ("deferred_release",)
    assert set(scenario.expect.must_include) == {"cross_tenant_canary", "unsafe_accept"}


def test_verify_exits_0_when_the_combination_closes_both(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "--fix", "admission_retire", "--fix", "deferred_release"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if "admission_retire+deferred_release" in line)
    assert row.split() == ["admission_retire+deferred_release", "-", "-"]


def test_an_unknown_fix_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--fix", "cache_salt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcanary: error: --fix cache_salt: the model has no such fix")
    assert len(err.strip().splitlines()) == 1


def test_missing_spin_is_one_line_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["verify", "--fix", "page_tags"]) == 3
    err = capsys.readouterr().err
    assert "spin and gcc not found on PATH" in err
    assert len(err.strip().splitlines()) == 1


def test_the_abort_counterexample_becomes_a_scenario_that_parses() -> None:
    result = runner.cell(frozenset(), "abort")
    scenario = parse_scenario(to_scenario(result), "<abort>")
    kinds = [step.kind for step in scenario.steps]
    assert kinds == ["disconnect", "victims"] * 3
    assert scenario.expect.outcome == "leak"
    assert scenario.expect.must_include == ("cross_tenant_canary",)


def test_the_placeholder_counterexample_reproduces_on_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = runner.cell(frozenset(), "placeholder")
    path = tmp_path / "model-placeholder.toml"
    path.write_text(to_scenario(result))
    assert main(["repro", str(path), "--out", str(tmp_path / "out")]) == 0
    stdout = capsys.readouterr().out
    assert "verdict: REPRODUCED - expected leak seen:" in stdout
    assert "cross_tenant_canary" in stdout
    assert "unsafe_accept" in stdout

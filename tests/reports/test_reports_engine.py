"""Reports of a real run: `kvcanary run` against the bundled engine (vulnerable preset),
recorded once, then re-rendered and checked like the recorded journals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcanary.harness.cli import main
from kvcanary.reports.render import RenderResult, render_run

pytestmark = pytest.mark.slow
SCHEMA = Path(__file__).with_name("junit.xsd")


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch", reason="the bundled engine needs torch")
    run_dir = tmp_path_factory.mktemp("engine") / "run"
    command = [
        sys.executable,
        "-m",
        "kvcanary.harness.cli",
        "run",
        "--requests",
        "16",
        "--seed",
        "3",
    ]
    result = subprocess.run(
        [*command, "--out", str(run_dir)], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 1, result.stderr[-3000:]  # the vulnerable preset leaks
    return run_dir


@pytest.fixture(scope="module")
def rerendered(engine_run: Path, tmp_path_factory: pytest.TempPathFactory) -> RenderResult:
    return render_run(engine_run, out_dir=tmp_path_factory.mktemp("again"))


def test_the_engine_run_is_reported_as_a_leak(rerendered: RenderResult) -> None:
    assert rerendered.errors == {}
    assert str(rerendered.verdict) == "leak"
    counts = rerendered.summary["counts"]["findings"]
    assert counts["cross_tenant_canary"] > 0
    assert counts["unsafe_accept"] > 0


def test_every_recorded_finding_is_in_every_format(
    engine_run: Path, rerendered: RenderResult
) -> None:
    lines = (engine_run / "journal.jsonl").read_text().splitlines()
    findings = [r for r in map(json.loads, lines) if r["type"] == "finding"]
    assert len(findings) == rerendered.summary["counts"]["findings_total"]
    texts = {name: rerendered.paths[name].read_text() for name in ("html", "md", "junit")}
    evidence = list(rerendered.paths["evidence"].iterdir())
    assert len(evidence) == len(findings)
    for finding in findings:
        for name, text in texts.items():
            assert finding["request_id"] in text, (name, finding["summary"])
    xmlschema = pytest.importorskip("xmlschema", reason="xmlschema validates junit.xml")
    xmlschema.XMLSchema(SCHEMA).validate(rerendered.paths["junit"])


def test_the_run_s_own_reports_match_a_re_render(
    engine_run: Path, rerendered: RenderResult
) -> None:
    own = json.loads((engine_run / "summary.json").read_text())
    assert own["verdict"] == rerendered.summary["verdict"]
    assert own["counts"] == rerendered.summary["counts"]


def test_kvcanary_report_exits_1_on_the_engine_run(
    engine_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(engine_run), "--out", str(tmp_path), "--format", "json"]) == 1
    assert capsys.readouterr().out.startswith("verdict: LEAK - ")

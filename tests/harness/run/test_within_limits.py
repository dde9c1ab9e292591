"""`kvcanary run --profile below` on the bundled hardened engine: clean, and says what it skipped.

The `below` profile plans no prompt above a limit, so the run tests leakage within the
limits only. The hardened engine quotes its own prompts noisily (copy noise 0.3: splices,
shuffles, and now and then a dropped token that glues two word pieces into another list
word); none of that may become a finding. A clean verdict must say that over-limit
handling was not tested, and the `unsafe_accept` check must read "not run", never passed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcanary.harness.cli import main

pytestmark = pytest.mark.slow


def test_the_hardened_engine_within_its_limits_is_clean_and_says_what_was_not_tested(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--engine-preset", "hardened", "--profile", "below", "--requests", "40"]
    status = main([*argv, "--seed", "3", "--out", str(tmp_path)])
    printed = capsys.readouterr()
    result: dict[str, Any] = json.loads((tmp_path / "summary.json").read_text())
    assert status == 0, (printed.out, result["counts"]["findings"])
    assert result["verdict"] == "clean"
    assert result["counts"]["findings_total"] == 0
    assert result["counts"]["requests"]["total"] == 40
    assert result["evidence"]["num_above_limit_sent"] == 0
    assert result["evidence"]["num_probes_sent"] > 0
    assert result["evidence"]["num_victims_accepted"] > 0
    assert "over-limit handling was not tested" in result["verdict_reasons"][0]
    assert result["checks"]["unsafe_accept"]["status"] == "not run"
    assert "no prompt above a limit was sent" in result["checks"]["unsafe_accept"]["why"]
    assert printed.out.startswith("verdict: CLEAN")
    assert "over-limit handling was not tested" in printed.out.splitlines()[0]
    journal = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    plans = [row for row in journal if row["type"] == "plan"]
    assert plans
    assert all(row["expected"] != "reject" for row in plans)
    echoes = [row for row in journal if row["type"] == "own_echo"]
    assert echoes, "the engine's noisy quotes made no own echo: the test exercised nothing"

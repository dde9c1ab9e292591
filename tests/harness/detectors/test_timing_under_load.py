"""The timing detector on the bundled vulnerable engine while every core is busy.

A machine under load is where timing used to pass vacuously: the noise scale grew until no
prompt within the context was long enough to judge, and nothing said so. With the CPU hog
running, every over-pool probe the engine answers must be flagged `fast_prefill`, or the
run must say that timing was not judged; check 6's bar is never at or below zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcanary.harness.cli import main
from kvcanary.harness.record.ttft_model import TtftModel

pytestmark = pytest.mark.slow


BURNERS_PER_CORE = 5
"""As in issue 14: about ten busy processes on two cores, so that the engine, the client and
the burners queue for the CPU and delays reach the hundreds of milliseconds."""


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """`BURNERS_PER_CORE` busy-looping processes per core, stopped after the test."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(BURNERS_PER_CORE * (os.cpu_count() or 2))
    ]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait(timeout=30)


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


@pytest.mark.timing
def test_over_pool_probes_under_a_cpu_hog_are_flagged_or_not_judged(
    tmp_path: Path, cpu_hog: None
) -> None:
    out = tmp_path / "run"
    assert main(["run", "--seed", "5", "--out", str(out)]) == 1
    rows = records(out)
    pool = rows[0]["limits"]["pool_tokens"]
    over_pool = {
        r["request_id"] for r in rows if r["type"] == "plan" and r["num_prompt_tokens"] > pool
    }
    answered = {
        r["request_id"]
        for r in rows
        if r["type"] == "observation"
        and r["request_id"] in over_pool
        and r["status"] == 200
        and r["t_first_token_ns"] is not None
    }
    assert answered, "the vulnerable engine answered no over-pool probe"
    fast = {r["request_id"] for r in rows if r["type"] == "finding" and r["kind"] == "fast_prefill"}
    summary = json.loads((out / "summary.json").read_text())
    timing = summary["timing"]
    if timing.get("not_judged"):
        assert timing["judged"] is False
        # said in the reports too, unless a fast_prefill finding already fails the check
        state = summary["checks"]["fast_prefill"]["status"]
        assert state in ("found", "not judged")
        if state == "not judged":
            assert "not judged" in (out / "report.md").read_text()
    else:
        assert answered <= fast, f"{len(answered - fast)} answered over-pool probe(s) not flagged"
    if timing["model"] is not None:
        model = TtftModel.from_dict(timing["model"])
        assert model.threshold(max(r["num_prompt_tokens"] for r in rows if r["type"] == "plan")) > 0

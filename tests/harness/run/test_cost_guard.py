"""The cost guard end to end: a plan over budget is refused before the target sees a single
request; a plan within it is sent exactly as totalled; a soak stops cleanly when its budget
is spent."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from misbehaving_server import serve
from test_cli_run import CONTEXT, LIMIT_FLAGS, POOL, fake_target, of_type, records
from test_runner import FakeSender, make_runner

from kvcanary.harness.cli import main
from kvcanary.harness.record.events import Event, Limits, PlanRecorded
from kvcanary.harness.run.cost_guard import plan_totals
from kvcanary.harness.run.runner import Budget, default_phases
from kvcanary.tenants.cost import CostBudget, SpendMeter
from kvcanary.tenants.workload import get_profile


def counting(app: Any) -> tuple[Any, list[str]]:
    """`app`, and the list of every request it is sent (method and path), GETs included."""
    seen: list[str] = []

    async def counted(scope: Any, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        seen.append(f"{scope['method']} {scope['path']}")
        await app(scope, receive, send)

    return counted, seen


def totals_of(num_requests: int) -> dict[str, int]:
    limits = Limits(POOL, CONTEXT, 16, "flags")
    profile = get_profile("incident")
    totals = plan_totals(
        profile,
        limits,
        "completions",
        num_requests=num_requests,
        phases=default_phases(profile.victim_fraction),
    )
    return {
        "num_requests": totals.num_requests,
        "num_prompt_tokens": totals.num_prompt_tokens,
        "num_completion_tokens": totals.num_completion_tokens,
    }


@pytest.mark.parametrize(
    ("flags", "figure"),
    [
        (["--max-requests", "10"], "20 requests > --max-requests 10"),
        (["--max-prompt-tokens", "1000"], "prompt tokens > --max-prompt-tokens 1,000"),
        (["--price-per-mtok", "1000,2000", "--max-cost", "1"], "> --max-cost 1"),
    ],
)
def test_a_plan_over_budget_exits_2_before_any_request_reaches_the_target(
    flags: list[str], figure: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app, seen = counting(fake_target())
    with serve(app) as url:
        argv = ["run", "--target", url, *LIMIT_FLAGS, "--requests", "20", *flags]
        status = main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert seen == []
    assert err[-1].startswith("kvcanary: error: the plan exceeds the cost guard: ")
    assert figure in err[-1]
    assert f"{totals_of(20)['num_prompt_tokens']:,} prompt tokens" in err[-1]
    assert not (tmp_path / "out" / "journal.jsonl").exists()


def test_a_cost_limit_without_prices_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--target", "http://127.0.0.1:9", "--max-cost", "5"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "--max-cost needs --price-per-mtok" in capsys.readouterr().err


def test_a_plan_within_budget_sends_what_was_totalled_and_summary_records_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    expected = totals_of(12)
    with serve(fake_target()) as url:
        argv = ["run", "--target", url, *LIMIT_FLAGS, "--requests", "12", "--tenants", "2"]
        budget = ["--max-requests", "12", "--max-prompt-tokens", str(expected["num_prompt_tokens"])]
        prices = ["--price-per-mtok", "1,2"]
        status = main([*argv, *budget, *prices, "--out", str(out)])
    assert status == 0, capsys.readouterr()
    plans = of_type(records(out), "plan")
    assert len(plans) == 12
    assert sum(p["num_prompt_tokens"] for p in plans) == expected["num_prompt_tokens"]
    spent = json.loads((out / "summary.json").read_text())["spent"]
    assert spent == {**spent, **expected}
    cost = (expected["num_prompt_tokens"] * 1 + expected["num_completion_tokens"] * 2) / 1e6
    assert spent["cost"] == pytest.approx(cost)
    assert spent["budget"]["max_requests"] == 12
    assert spent["num_completion_tokens_reported"] > 0


async def test_a_soak_stops_cleanly_when_its_budget_is_spent() -> None:
    events: list[Event] = []
    meter = SpendMeter(CostBudget(max_requests=5))
    budget = Budget(duration_s=3600.0)
    runner = make_runner(FakeSender(), events.append, budget=budget, admit=meter.admit)
    outcome = await runner.run()
    assert outcome.reason == "budget_spent"
    assert sum(isinstance(e, PlanRecorded) for e in events) == 5
    assert outcome.num_observations == 5  # every request sent was finished, none cancelled


def test_a_soak_over_budget_ends_cleanly_with_the_budget_spent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "soak"
    with serve(fake_target()) as url:
        argv = ["soak", "--target", url, *LIMIT_FLAGS, "--duration", "10m", "--out", str(out)]
        main([*argv, "--concurrency", "2", "--max-requests", "6"])
    err = capsys.readouterr().err
    assert "stops cleanly when its budget is spent" in err
    rows = records(out)
    assert rows[-1]["type"] == "run_finished"
    assert rows[-1]["reason"] == "budget_spent"
    assert len(of_type(rows, "plan")) == len(of_type(rows, "observation")) == 6
    assert json.loads((out / "summary.json").read_text())["spent"]["num_requests"] == 6

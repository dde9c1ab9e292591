"""Audit figures the target does not report, given as --pool-tokens / --context-tokens, and
where each compared figure came from."""

from __future__ import annotations

import json
from typing import Any

import pytest
from recorded_targets import (
    Handler,
    RecordedTarget,
    fixture_json,
    json_reply,
    mock_client,
    serving,
    vllm_routes,
)

from kvcanary.harness.cli import main
from kvcanary.harness.target.audit import SideVerdict, run_audit

BASE = "http://target"
CONTEXT_ONLY = {"GET /v1/models": json_reply({"data": [{"id": "m", "max_model_len": 8192}]})}


async def audit_of(routes: dict[str, Handler], **kwargs: Any) -> Any:
    target = RecordedTarget(routes)
    async with mock_client({"target": target}) as client:
        return await run_audit(client, target=BASE, **kwargs)


def sources(result: Any) -> dict[str, str]:
    return {f.name: f.source for f in result.figures}


async def test_a_given_pool_fills_in_what_the_target_does_not_report() -> None:
    result = await audit_of(CONTEXT_ONLY, pool_tokens=4096)
    (side,) = result.sides
    assert (side.verdict, side.side.pool_tokens, side.side.context_tokens) == (
        SideVerdict.POOL_SMALLER_THAN_CONTEXT,
        4096,
        8192,
    )
    assert sources(result) == {
        "context_tokens": "read: openai:/v1/models",
        "pool_tokens": "given: --pool-tokens",
    }
    (finding,) = result.findings
    assert finding.details["pool_source"] == "given: --pool-tokens"
    assert result.exit_status == 1


async def test_both_figures_given_for_a_target_that_reports_nothing() -> None:
    result = await audit_of({}, pool_tokens=16384, context_tokens=8192)
    (side,) = result.sides
    assert side.verdict is SideVerdict.OK
    assert result.facts.context_source == "given: --context-tokens"
    assert sources(result) == {
        "context_tokens": "given: --context-tokens",
        "pool_tokens": "given: --pool-tokens",
    }
    assert result.exit_status == 0


async def test_a_figure_the_target_reports_is_not_replaced_and_the_output_says_so() -> None:
    result = await audit_of(vllm_routes(), pool_tokens=1, context_tokens=2)
    assert result.exit_status == 0  # vLLM's own figures were compared
    by_name = {f.name: f for f in result.figures}
    assert by_name["context_tokens"].source == "read: openai:/v1/models"
    assert by_name["context_tokens"].note == "--context-tokens 2 not used"
    assert by_name["pool_tokens"].source == "read: vllm:/metrics"
    assert by_name["pool_tokens"].note == "--pool-tokens 1 not used"


async def test_without_flags_a_missing_pool_stays_unknown() -> None:
    result = await audit_of(CONTEXT_ONLY)
    assert sources(result)["pool_tokens"] == "unknown"
    assert result.exit_status == 3


async def test_llamacpp_figures_are_read_from_props_and_the_model_card() -> None:
    routes = {
        "GET /props": json_reply(fixture_json("llamacpp_props.json")),
        "GET /v1/models": json_reply(fixture_json("llamacpp_models.json")),
    }
    result = await audit_of(routes)
    assert result.facts.engine == "llamacpp"
    assert sources(result) == {
        "context_tokens": "read: llamacpp:/v1/models meta.n_ctx",
        "pool_tokens": "read: llamacpp:/props",
    }
    assert result.exit_status == 0


def test_cli_says_which_figures_it_read_and_which_it_was_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with serving(RecordedTarget(dict(CONTEXT_ONLY))) as url:
        status = main(["audit", "--target", url, "--pool-tokens", "4096"])
        out, _ = capsys.readouterr()
        assert status == 1
        assert "context_tokens 8,192 (advertised): read: openai:/v1/models" in out
        assert f"pool_tokens 4,096 (unified {url}): given: --pool-tokens" in out
        status = main(["audit", "--target", url, "--pool-tokens", "9000", "--json"])
        record = json.loads(capsys.readouterr().out)
    assert status == 0
    assert {f["name"]: f["source"] for f in record["figures"]} == {
        "context_tokens": "read: openai:/v1/models",
        "pool_tokens": "given: --pool-tokens",
    }


def test_cli_rejects_a_non_positive_figure_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--target", BASE, "--pool-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "--pool-tokens" in err
    assert "Traceback" not in err

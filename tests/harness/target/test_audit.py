"""The audit: per-side verdicts, findings, the probe, and `kvcanary audit` as a black box."""

from __future__ import annotations

import json
from typing import Any

import pytest
from recorded_targets import (
    Handler,
    RecordedTarget,
    Reply,
    Seen,
    fixture_json,
    free_port,
    json_reply,
    mini_lb_routes,
    mock_client,
    serving,
    sglang_routes,
    vllm_routes,
)

from kvcanary.harness.cli import main
from kvcanary.harness.record.finding import FindingKind, Severity
from kvcanary.harness.record.verdict import Verdict
from kvcanary.harness.target.audit import (
    ProbeOutcome,
    SideVerdict,
    audit_facts,
    probe_over_limit,
    redact_url,
    run_audit,
)
from kvcanary.harness.target.server_info import read_engine_facts

BASE = "http://target"


def small_pd_routes(
    *, accept: bool, tokenize: bool = True, tokens_per_word: int = 1
) -> dict[str, Handler]:
    """A PD deployment whose prefill pool (1024) is below its context (4096); the probe's
    fate is set by `accept`."""
    info = {
        "internal_states": [],
        "prefill": [
            {"max_total_num_tokens": 1024, "page_size": 16, "disaggregation_mode": "prefill"}
        ],
        "decode": [
            {"max_total_num_tokens": 8192, "page_size": 16, "disaggregation_mode": "decode"}
        ],
    }
    routes = {
        "GET /get_server_info": json_reply(info),
        "GET /v1/models": json_reply({"data": [{"id": "tiny", "max_model_len": 4096}]}),
    }

    def completions(seen: Seen) -> Reply:
        if accept:
            body = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 1}}
            return 200, "application/json", json.dumps(body).encode()
        return 400, "application/json", b'{"object":"error","message":"too long","code":400}'

    def count(seen: Seen) -> Reply:
        num_tokens = len(json.loads(seen.body)["prompt"].split()) * tokens_per_word + 1
        body = {"tokens": [7] * num_tokens, "count": num_tokens, "max_model_len": 4096}
        return 200, "application/json", json.dumps(body).encode()

    routes["POST /v1/completions"] = completions
    if tokenize:
        routes["POST /v1/tokenize"] = count
    return routes


async def audit_of(routes: dict[str, Handler], **kwargs: Any) -> Any:
    target = RecordedTarget(routes)
    async with mock_client({"target": target}) as client:
        return await run_audit(client, target=BASE, **kwargs)


# --- the comparison --------------------------------------------------------------------------


async def test_prefill_pool_below_context_is_a_finding_and_decode_is_ok() -> None:
    result = await audit_of(mini_lb_routes())
    verdicts = {s.side.role: (s.verdict, round(s.ratio, 3)) for s in result.sides}
    assert verdicts == {
        "prefill": (SideVerdict.POOL_SMALLER_THAN_CONTEXT, 0.646),
        "decode": (SideVerdict.OK, 5.172),
    }
    (finding,) = result.findings
    assert finding.kind is FindingKind.POOL_SMALLER_THAN_CONTEXT
    assert finding.severity is Severity.HIGH
    assert finding.detector == "audit"
    assert finding.summary == (
        f"prefill side {BASE}#prefill[0] (10.0.3.11:30000): KV pool of 131072 tokens is "
        "smaller than the advertised context of 202752 tokens (ratio 0.646)"
    )
    assert finding.details["pool_source"] == "sglang:/get_server_info"
    assert finding.details["context_source"] == "openai:/v1/models"
    assert finding.details["source_fields"]["max_total_num_tokens"] == 131072
    assert finding.details["other_sides"][0]["pool_tokens"] == 1048576
    assert result.verdict is Verdict.UNSAFE
    assert result.exit_status == 1


async def test_a_pool_equal_to_the_context_is_ok() -> None:
    routes = {
        "GET /get_server_info": json_reply({"max_total_num_tokens": 4096}),
        "GET /v1/models": json_reply({"data": [{"id": "m", "max_model_len": 4096}]}),
    }
    result = await audit_of(routes)
    assert [s.verdict for s in result.sides] == [SideVerdict.OK]
    assert result.verdict is Verdict.CLEAN
    assert result.exit_status == 0


async def test_vllm_target_is_clean() -> None:
    result = await audit_of(vllm_routes())
    assert [(s.verdict, s.side.pool_tokens) for s in result.sides] == [(SideVerdict.OK, 432000)]
    assert result.exit_status == 0


async def test_single_sglang_server_with_a_small_pool_is_flagged() -> None:
    result = await audit_of(sglang_routes())
    assert [s.verdict for s in result.sides] == [SideVerdict.POOL_SMALLER_THAN_CONTEXT]
    assert result.findings[0].details["max_input_tokens"] == 65530


async def test_an_engine_exposing_nothing_is_inconclusive_never_clean() -> None:
    result = await audit_of({})
    assert result.sides == ()
    assert result.findings == ()
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.exit_status == 3
    assert len(result.to_dict()["attempts"]) == 4


async def test_a_known_context_without_a_pool_is_unknown() -> None:
    result = await audit_of({"GET /v1/models": json_reply({"data": [{"max_model_len": 8}]})})
    assert [(s.verdict, s.reason) for s in result.sides] == [
        (SideVerdict.UNKNOWN, "could not read the KV pool size")
    ]
    assert result.exit_status == 3


async def test_one_unknown_side_keeps_a_clean_side_from_passing_the_audit() -> None:
    info = {
        "prefill": [{"max_total_num_tokens": 9000}],
        "decode": [{"disaggregation_mode": "decode"}],
    }
    routes = {
        "GET /get_server_info": json_reply(info),
        "GET /v1/models": json_reply({"data": [{"max_model_len": 8192}]}),
    }
    result = await audit_of(routes)
    assert [s.verdict for s in result.sides] == [SideVerdict.OK, SideVerdict.UNKNOWN]
    assert result.verdict is Verdict.INCONCLUSIVE


async def test_audit_facts_makes_no_request() -> None:
    target = RecordedTarget(mini_lb_routes())
    async with mock_client({"target": target}) as client:
        facts = await read_engine_facts(client, BASE)
    num_seen = len(target.seen)
    result = audit_facts(facts)
    assert len(result.findings) == 1
    assert len(target.seen) == num_seen


def test_credentials_in_urls_are_redacted() -> None:
    assert redact_url("https://alice:pw@host:8000/v1") == "https://***@host:8000/v1"
    assert redact_url("http://host/v1") == "http://host/v1"


# --- the probe -------------------------------------------------------------------------------


async def test_an_accepted_over_pool_probe_is_an_unsafe_accept() -> None:
    result = await audit_of(small_pd_routes(accept=True), probe=True)
    probe = result.probe
    assert probe.outcome is ProbeOutcome.ACCEPTED
    assert probe.limit_tokens == 1024
    assert 1024 + 16 <= probe.num_tokens <= 1024 + 2 * 16
    assert probe.token_count == "exact (server /v1/tokenize)"
    assert probe.prompt_tokens_reported == 1
    kinds = [f.kind for f in result.findings]
    assert kinds == [FindingKind.POOL_SMALLER_THAN_CONTEXT, FindingKind.UNSAFE_ACCEPT]
    accept = result.findings[1]
    assert "usage.prompt_tokens=1" in accept.summary
    assert accept.details["role"] == "prefill"
    assert result.exit_status == 1


async def test_a_rejected_probe_adds_no_finding() -> None:
    routes = small_pd_routes(accept=False)
    target = RecordedTarget(routes)
    async with mock_client({"target": target}) as client:
        result = await run_audit(client, target=BASE, probe=True, headers={"X-Key": "k"})
    assert result.probe.outcome is ProbeOutcome.REJECTED
    assert result.probe.status == 400
    assert [f.kind for f in result.findings] == [FindingKind.POOL_SMALLER_THAN_CONTEXT]
    (sent,) = [s for s in target.seen if s.path == "/v1/completions"]
    body = json.loads(sent.body)
    assert (body["model"], body["max_tokens"], body["stream"]) == ("tiny", 1, False)
    assert sent.headers["x-key"] == "k"


@pytest.mark.parametrize("status", [404, 401, 429, 500, 503])
async def test_a_probe_answered_without_a_length_check_is_inconclusive(status: int) -> None:
    routes = small_pd_routes(accept=True)
    routes["POST /v1/completions"] = json_reply({"error": "no"}, status=status)
    routes["GET /get_server_info"] = json_reply({"max_total_num_tokens": 8192})
    result = await audit_of(routes, probe=True)
    assert result.probe.outcome is ProbeOutcome.INCONCLUSIVE
    assert result.probe.status == status
    assert result.findings == ()
    assert result.exit_status == 3


async def test_probe_without_a_tokenizer_endpoint_sends_one_word_per_token() -> None:
    result = await audit_of(small_pd_routes(accept=False, tokenize=False), probe=True)
    assert result.probe.num_tokens == 1024 + 16
    assert result.probe.token_count.startswith("at least")


async def test_probe_is_rescaled_for_a_tokenizer_that_splits_the_filler() -> None:
    target = RecordedTarget(small_pd_routes(accept=False, tokens_per_word=2))
    async with mock_client({"target": target}) as client:
        probe = await probe_over_limit(client, BASE, limit_tokens=1024, page_size=16, model="m")
    assert 1024 + 16 <= probe.num_tokens <= 1024 + 2 * 16
    (sent,) = [s for s in target.seen if s.path == "/v1/completions"]
    assert len(json.loads(sent.body)["prompt"].split()) * 2 + 1 == probe.num_tokens


async def test_probe_is_skipped_when_no_pool_was_read() -> None:
    routes = {"GET /v1/models": json_reply({"data": [{"max_model_len": 8}]})}
    result = await audit_of(routes, probe=True)
    assert result.probe.outcome is ProbeOutcome.SKIPPED
    assert result.exit_status == 3


async def test_probe_uses_the_context_when_the_pool_is_larger() -> None:
    routes = small_pd_routes(accept=False)
    routes["GET /v1/models"] = json_reply({"data": [{"id": "tiny", "max_model_len": 512}]})
    result = await audit_of(routes, probe=True)
    assert result.probe.limit_tokens == 512
    assert result.verdict is Verdict.CLEAN


# --- the command -----------------------------------------------------------------------------


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["audit", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_flags_the_prefill_side(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(RecordedTarget(mini_lb_routes())) as url:
        status, out, _ = cli(capsys, "--target", url)
    assert status == 1
    assert "pool_smaller_than_context" in out
    prefill_row = next(line for line in out.splitlines() if "prefill" in line and "131,072" in line)
    assert "202,752" in prefill_row
    assert "0.646" in prefill_row
    decode_row = next(line for line in out.splitlines() if "decode" in line and "1,048,576" in line)
    assert " ok " in decode_row
    assert "verdict: unsafe (1 finding)" in out


def test_cli_json_is_machine_readable_and_free_of_credentials(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCANARY_TEST_KEY", "sk-very-secret")
    info = fixture_json("sglang_mini_lb_server_info.json")
    info["prefill"][0]["api_key"] = "sk-server-args-secret"  # SGLang flattens server args
    target = RecordedTarget(dict(mini_lb_routes(), **{"GET /get_server_info": json_reply(info)}))
    with serving(target) as url:
        status, out, _ = cli(
            capsys, "--target", url, "--json", "--api-key-env", "KVCANARY_TEST_KEY"
        )
    assert status == 1
    result = json.loads(out)
    assert result["verdict"] == "unsafe"
    assert result["exit_status"] == 1
    assert [(s["role"], s["pool_tokens"], s["verdict"]) for s in result["sides"]] == [
        ("prefill", 131072, "pool_smaller_than_context"),
        ("decode", 1048576, "ok"),
    ]
    assert result["findings"][0]["kind"] == "pool_smaller_than_context"
    assert "sk-very-secret" not in out
    assert "sk-server-args-secret" not in out
    assert all(s.headers.get("authorization") == "Bearer sk-very-secret" for s in target.seen)


def test_cli_engine_exposing_nothing_exits_3_and_says_what_was_tried(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with serving(RecordedTarget({})) as url:
        status, out, _ = cli(capsys, "--target", url)
    assert status == 3
    assert "could not read the pool size" in out
    assert f"GET {url}/get_server_info: HTTP 404" in out
    assert f"GET {url}/metrics: HTTP 404" in out
    assert "verdict: inconclusive" in out
    assert "clean" not in out


def test_cli_unreachable_target_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = cli(capsys, "--target", f"http://127.0.0.1:{free_port()}", "--json")
    assert status == 3
    result = json.loads(out)
    assert result["verdict"] == "inconclusive"
    assert result["attempts"][0]["error"].startswith("unreachable")


def test_cli_clean_vllm_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(RecordedTarget(vllm_routes())) as url:
        status, out, _ = cli(capsys, "--target", url)
    assert status == 0
    assert "verdict: clean (0 findings)" in out


def test_cli_named_sides(capsys: pytest.CaptureFixture[str]) -> None:
    prefill = RecordedTarget({"GET /get_server_info": json_reply({"max_total_num_tokens": 2048})})
    decode = RecordedTarget({"GET /get_server_info": json_reply({"max_total_num_tokens": 9999})})
    models = RecordedTarget({"GET /v1/models": json_reply({"data": [{"max_model_len": 4096}]})})
    with serving(prefill) as p, serving(decode) as d, serving(models) as router:
        status, out, _ = cli(capsys, "--target", router, "--prefill", p, "--decode", d, "--json")
    assert status == 1
    sides = json.loads(out)["sides"]
    assert [(s["role"], s["url"], s["verdict"]) for s in sides] == [
        ("prefill", p, "pool_smaller_than_context"),
        ("decode", d, "ok"),
    ]


def test_cli_probe_accepted_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(RecordedTarget(small_pd_routes(accept=True))) as url:
        status, out, _ = cli(capsys, "--target", url, "--probe")
    assert status == 1
    assert "probe " in out
    assert ": accepted (" in out
    assert "unsafe_accept" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "needs --target"),
        (["--prefill", "http://127.0.0.1:1", "--probe"], "--probe"),
        (["--target", "localhost:8000"], "not an http(s) URL"),
        (["--target", "http://127.0.0.1:1", "--api-key-env", "KVCANARY_UNSET_VAR"], "not set"),
        (["--target", "http://127.0.0.1:1", "--timeout", "0"], "--timeout"),
    ],
)
def test_cli_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, _, err = cli(capsys, *argv)
    assert status == 2
    assert message in err
    assert err.count("\n") == 1  # one line, no traceback


# --- the bundled reference engine ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "expected", "probe_outcome"),
    [("vulnerable", 1, "accepted"), ("hardened", 0, "rejected")],
)
def test_bundled_engine(
    capsys: pytest.CaptureFixture[str], preset: str, expected: int, probe_outcome: str
) -> None:
    from kvcanary.reference_engine.server.launch import running_engine  # torch: only when this runs

    with running_engine(preset, context_length=1024) as engine:
        status, out, _ = cli(capsys, "--target", engine.base_url, "--json", "--probe")
    result = json.loads(out)
    assert status == expected, out
    assert result["engine"] == "kvcanary-reference"
    verdicts = {s["role"]: s["verdict"] for s in result["sides"]}
    kinds = [f["kind"] for f in result["findings"]]
    probe = result["probe"]
    assert probe["outcome"] == probe_outcome, probe
    assert probe["token_count"].startswith("exact")  # the engine's /v1/tokenize counted
    if preset == "vulnerable":
        assert verdicts == {"prefill": "pool_smaller_than_context", "decode": "ok"}
        assert kinds == ["pool_smaller_than_context", "unsafe_accept"]
    else:
        assert verdicts == {"prefill": "ok", "decode": "ok"}
        assert kinds == []
        assert probe["status"] == 400

"""`kvcanary repro`: verdicts, exit statuses, and every shipped scenario against the bundled
engine (the leaks reproduce, the hardened control stays clean).

The engine runs in this process for speed (`engine_processes=False`); one test goes through
the command line and starts it as separate processes, as `kvcanary repro` does.
"""

from __future__ import annotations

import io
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from misbehaving_server import read_body, serve

from kvcanary.canaries import load_tokenizer
from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.cli import main
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.scenarios.repro import ReproResult, StepReport, judge, run_repro
from kvcanary.harness.scenarios.schema import (
    Expectation,
    SendStep,
    WaitStep,
    parse_scenario,
    resolve_scenario,
)
from kvcanary.tenants.size import size

CTI, UA, PTM = (
    FindingKind.CROSS_TENANT_CANARY,
    FindingKind.UNSAFE_ACCEPT,
    FindingKind.PROMPT_TOKENS_MISMATCH,
)


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the verdict ---------------------------------------------------------------------------


def send_step(kind: str = "victims") -> SendStep:
    intent = {"victims": "victim", "probes": "probe"}[kind]
    spec = size("0.5*limit", intent)  # type: ignore[arg-type]
    return SendStep(kind, kind, 1, (spec,), 2, 1, 16)  # type: ignore[arg-type]


def report(kind: str = "victims", *, ok: int = 2, **errors: int) -> StepReport:
    return StepReport(1, send_step(kind), num_requests=ok + sum(errors.values()), num_ok=ok,
                      errors=errors)  # fmt: skip


LEAK = Expectation("leak", (CTI, UA), (FindingKind.FAST_PREFILL,))
CLEAN = Expectation("clean")


@pytest.mark.parametrize(
    ("expect", "findings", "steps", "ended", "verdict", "reason"),
    [
        (LEAK, {"cross_tenant_canary": 2, "unsafe_accept": 1}, [report()], "completed",
         "reproduced", "expected leak seen: 2 cross_tenant_canary, 1 unsafe_accept"),
        (LEAK, {"unsafe_accept": 1}, [report()], "completed", "not reproduced",
         "the expected leak did not happen: no cross_tenant_canary finding in 2 request(s) "
         "(found only 1 unsafe_accept)"),
        (LEAK, {"cross_tenant_canary": 1, "unsafe_accept": 1, "fast_prefill": 1}, [report()],
         "completed", "not reproduced", "found fast_prefill, which the scenario says must not"),
        (LEAK, {}, [report(ok=0, connect=2)], "completed", "inconclusive",
         "step 1 (victims): 2 of 2 request(s) failed (2 connect)"),
        (LEAK, {}, [report(ok=0, http_status=2)], "completed", "inconclusive",
         "no victim was accepted"),
        (LEAK, {}, [report()], "interrupted", "inconclusive", "the run ended early"),
        (LEAK, {"cross_tenant_canary": 1, "unsafe_accept": 1}, [report(ok=1, timeout=1)],
         "completed", "reproduced", "expected leak seen"),
        (Expectation("leak"), {}, [report()], "completed", "not reproduced", "no any finding"),
        (Expectation("leak"), {"unknown_canary": 1}, [report()], "completed", "reproduced",
         "1 unknown_canary"),
        (CLEAN, {}, [report(), report("probes", ok=0, http_status=2)], "completed",
         "reproduced", "clean as expected: no finding in 4 request(s)"),
        (CLEAN, {"unsafe_accept": 1}, [report()], "completed", "not reproduced",
         "the clean control leaked: 1 unsafe_accept"),
        (CLEAN, {}, [report("probes", ok=0, protocol=2)], "completed", "inconclusive",
         "failed (2 protocol)"),
    ],
)  # fmt: skip
def test_judge(
    expect: Expectation,
    findings: dict[str, int],
    steps: list[StepReport],
    ended: str,
    verdict: str,
    reason: str,
) -> None:
    got, reasons = judge(expect, findings, steps, ended)
    assert got == verdict
    assert reason in " ".join(reasons)


def test_wait_steps_never_count_as_failed() -> None:
    wait = StepReport(2, WaitStep("pause", 3, 0.1))
    assert judge(CLEAN, {}, [report(), wait], "completed")[0] == "reproduced"


# -- usage errors and unreachable targets --------------------------------------------------


def test_an_unreachable_target_is_inconclusive_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    out = tmp_path / "out"
    assert main(["repro", "glm53-incident-target", "--target", url, "--out", str(out)]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith(f"verdict: INCONCLUSIVE - cannot reach the target at {url}")
    assert lines[3] == "  evidence  none: nothing was sent"
    assert not out.exists()


def test_a_scenario_without_a_target_or_engine_needs_target(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["repro", "glm53-incident-target"]) == 2
    assert "runs against a deployment: pass --target URL" in capsys.readouterr().err


def test_an_unset_key_variable_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["repro", "glm53-incident", "--api-key-env", "KVCANARY_TEST_UNSET_KEY"]
    assert main(argv) == 2
    assert "KVCANARY_TEST_UNSET_KEY is not set" in capsys.readouterr().err


def tiny(size: str, page_size: int = 16) -> str:
    """A scenario against a fake target whose only step sends one prompt of `size`."""
    return "\n".join(
        [
            'name = "tiny"',
            'description = "a size that only fails against real limits"',
            'target = "http://fake.test"',
            "[limits]",
            "pool_tokens = 512",
            "context_tokens = 1024",
            f"page_size = {page_size}",
            "[[steps]]",
            'kind = "probes"',
            f'sizes = ["{size}"]',
            "[expect]",
            'outcome = "leak"',
        ]
    )


def models_only(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 1024}]})
    return httpx.Response(404, json={"error": {"message": "not found"}})


def test_a_size_too_small_for_the_real_limits_names_its_line(tmp_path: Path) -> None:
    scenario = parse_scenario(tiny("pool-1000"), "tiny.toml")
    with pytest.raises(ConfigError, match=r"^tiny\.toml:8: steps\[1\]\.sizes: size expression"):
        run_repro(scenario, out=tmp_path / "out", file=io.StringIO(),
                  transport=httpx.MockTransport(models_only))  # fmt: skip
    assert not (tmp_path / "out").exists()  # nothing was sent


def test_a_prompt_that_cannot_be_built_names_its_step_and_ends_the_journal(
    tmp_path: Path,
) -> None:
    scenario = parse_scenario(tiny("100", page_size=4), "tiny.toml")
    with pytest.raises(ConfigError, match=r"^tiny\.toml:8: steps\[1\]\.sizes: .*page size 4"):
        run_repro(scenario, out=tmp_path / "out", file=io.StringIO(),
                  transport=httpx.MockTransport(models_only))  # fmt: skip
    last = records(tmp_path / "out")[-1]
    assert (last["type"], last["reason"]) == ("run_finished", "error")


# -- shipped scenarios on the bundled engine -----------------------------------------------


def run_shipped(name: str, tmp_path: Path, **kwargs: Any) -> ReproResult:
    scenario = resolve_scenario(name)
    return run_repro(
        scenario, out=tmp_path / "out", file=io.StringIO(), engine_processes=False, **kwargs
    )


def test_glm53_incident_reproduces_with_a_full_evidence_bundle(tmp_path: Path) -> None:
    result = run_shipped("glm53-incident", tmp_path)
    assert result.verdict == "reproduced", result.reasons
    assert result.exit_status == 0
    assert {"cross_tenant_canary", "unsafe_accept"} <= set(result.findings)
    assert "prompt_tokens_mismatch" not in result.findings  # the client sees decode's usage
    out = tmp_path / "out"
    for name in ("journal.jsonl", "summary.json", "report.html", "report.md", "junit.xml"):
        assert (out / name).is_file(), name
    assert any((out / "evidence").iterdir())
    rows = records(out)
    started = rows[0]
    assert started["type"] == "run_started"
    assert started["settings"]["scenario"] == "glm53-incident"
    assert started["limits"]["pool_tokens"] == 656  # discovered from the engine
    phases = [r["phase"] for r in rows if r["type"] == "phase"]
    assert phases == ["1-victims", "2-probes"]
    assert [r["type"] for r in rows].count("run_finished") == 1
    assert rows[-1] == {**rows[-1], "type": "run_finished", "reason": "completed"}
    plans = [r for r in rows if r["type"] == "plan"]
    assert [p["tenant"] for p in plans] == [
        "tenant-1", "tenant-2", "tenant-3", "tenant-1", "tenant-0", "tenant-0",
    ]  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "leak"


def test_sglang_30233_reproduces_through_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["repro", "sglang-30233", "--out", str(out)]) == 0  # engine in 3 processes
    stdout = capsys.readouterr().out
    assert "verdict: REPRODUCED - expected leak seen:" in stdout
    assert f"  run dir   {out}" in stdout
    assert f"  report    {out / 'report.html'}" in stdout
    probe = next(
        r for r in records(out) if r["type"] == "observation" and r["request_id"].startswith("t0")
    )
    assert probe["status"] == 200
    plan = next(r for r in records(out) if r["type"] == "plan" and r["intent"] == "probe")
    assert plan["num_prompt_tokens"] == 640 + 9
    # the router relays decode's usage: prefill's prompt_tokens=1 never reaches the client
    assert probe["usage"]["prompt_tokens"] == plan["num_prompt_tokens"]


def test_hardened_control_stays_clean(tmp_path: Path) -> None:
    result = run_shipped("hardened-control", tmp_path)
    assert result.verdict == "reproduced", result.reasons
    assert result.findings == {}
    probes = [s for s in result.steps if s.step.kind == "probes"]
    assert probes[0].errors == {"http_status": 2}  # both over-limit probes were refused


def test_patched_control_refuses_the_incidents_probes_and_stays_clean(tmp_path: Path) -> None:
    result = run_shipped("patched-control", tmp_path)
    assert result.verdict == "reproduced", result.reasons
    assert result.findings == {}
    started = records(tmp_path / "out")[0]
    assert started["limits"]["pool_tokens"] == 656  # the incident's pool, below the context
    probes = [s for s in result.steps if s.step.kind == "probes"]
    assert probes[0].errors == {"http_status": 2}  # both over-pool probes got their 400


@pytest.mark.timeout(900)  # 14 s idle, 1.5-2.5 min at 4 burners, past 300 s at load 16
@pytest.mark.timing
def test_mid_transfer_abort_reproduces_from_requests_dropped_before_their_first_byte(
    tmp_path: Path,
) -> None:
    result = run_shipped("mid-transfer-abort", tmp_path)
    assert result.verdict == "reproduced", result.reasons
    assert not {"unsafe_accept", "prompt_tokens_mismatch"} & set(result.findings)
    drops = [s for s in result.steps if s.step.kind == "disconnect"]
    assert [s.errors for s in drops] == [{"disconnected": 1}] * 3
    rows = records(tmp_path / "out")
    dropped = [r for r in rows if r["type"] == "observation" and r["tenant"] == "tenant-1"]
    assert all(r["status"] is None and r["num_chunks"] == 0 for r in dropped)
    leaks = [r for r in rows if r["type"] == "finding" and r["kind"] == "cross_tenant_canary"]
    assert leaks
    assert {(r["tenant"], r["victim_tenant"]) for r in leaks} == {("tenant-0", "tenant-1")}


# -- targets given on the command line -----------------------------------------------------


@pytest.fixture(scope="module")
def vulnerable_url() -> Iterator[str]:
    from kvcanary.reference_engine.server.launch import running_engine

    with running_engine("vulnerable", context_length=1024) as engine:
        yield engine.base_url


@pytest.fixture(scope="module")
def hardened_url() -> Iterator[str]:
    from kvcanary.reference_engine.server.launch import running_engine

    with running_engine("hardened", context_length=1024) as engine:
        yield engine.base_url


def test_the_target_scenario_takes_the_targets_real_limits_as_params(
    vulnerable_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    params = ["pool_tokens=656", "context_tokens=1024", "num_victims=4", "num_probes=2"]
    argv = ["repro", "glm53-incident-target", "--target", vulnerable_url, "--out", str(out)]
    assert main([*argv, *(arg for p in params for arg in ("--param", p))]) == 0
    assert "verdict: REPRODUCED" in capsys.readouterr().out
    started = records(out)[0]
    assert started["limits"]["pool_tokens"] == 656
    assert started["limits"]["source"].startswith("pool: flags; context: flags")
    assert started["settings"]["param.num_victims"] == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["requests_by_intent"] == {"victim": 4, "probe": 2}


def test_an_expected_leak_that_does_not_happen_exits_1(
    hardened_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["repro", "glm53-incident", "--target", hardened_url, "--out", str(tmp_path / "o")]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "verdict: NOT REPRODUCED - the expected leak did not happen: no " in out


def test_a_clean_control_that_leaks_exits_1(
    vulnerable_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["repro", "hardened-control", "--target", vulnerable_url, "--out", str(tmp_path / "o")]
    assert main(argv) == 1
    assert "verdict: NOT REPRODUCED - the clean control leaked: " in capsys.readouterr().out


def test_repro_refuses_an_out_that_holds_a_run(
    hardened_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "journal.jsonl").write_text("")
    assert main(["repro", "hardened-control", "--target", hardened_url, "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err


BUSY = """\
name = "busy"
description = "many small victims at once: an event loop that is always running a task"
[limits]
pool_tokens = 384
context_tokens = 768
page_size = 16
[client]
model = "m"
tokenizer = "cl100k_base"
[tenants]
count = 2
[[steps]]
kind = "victims"
sizes = ["0.25*limit"]
count = 20000
concurrency = 16
max_tokens = 4
[expect]
outcome = "clean"
"""


@pytest.mark.slow
def test_sigterm_ends_a_repro_with_its_verdict_and_no_task_traceback(tmp_path: Path) -> None:
    """SIGTERM while a busy loop is running tasks: a KeyboardInterrupt raised inside one
    of them ended it with an exception nobody retrieved ("Task exception was never
    retrieved", 60-80 lines of traceback at exit). Now the run is cancelled where it awaits:
    exit 3, the verdict block, and nothing else."""
    scenario = tmp_path / "busy.toml"
    scenario.write_text(BUSY)
    with serve(counting_target()) as url:
        for attempt in range(3):
            out = tmp_path / f"out{attempt}"
            argv = [sys.executable, "-m", "kvcanary", "repro", str(scenario)]
            argv += ["--target", url, "--out", str(out)]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                _wait_for_observations(out, 40 + 40 * attempt, proc)
                proc.send_signal(signal.SIGTERM)
                printed, errors = proc.communicate(timeout=180)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            assert proc.returncode == 3, errors
            assert "Traceback" not in errors, errors
            assert "never retrieved" not in errors, errors
            assert "verdict: INCONCLUSIVE - the run ended early (interrupted)" in printed
            assert records(out)[-1]["type"] == "run_finished"


def counting_target() -> Any:
    """A safe target that answers at once, counting prompts in cl100k_base as the run does."""
    tokenizer = load_tokenizer("cl100k_base")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = await read_body(receive)
        if scope["method"] != "POST":
            await _respond(send, 404, b"application/json", b'{"error": "not found"}')
            return
        request = json.loads(body)
        usage = {"prompt_tokens": len(tokenizer.encode(request["prompt"])), "completion_tokens": 1}
        choice = {"index": 0, "text": " x", "finish_reason": "length"}
        if not request.get("stream"):
            answer = json.dumps({"choices": [choice], "usage": usage}).encode()
            await _respond(send, 200, b"application/json", answer)
            return
        events = [{"choices": [choice]}, {"choices": [], "usage": usage}]
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
        await _respond(send, 200, b"text/event-stream", data + b"data: [DONE]\n\n")

    return app


async def _respond(send: Any, status: int, content_type: bytes, body: bytes) -> None:
    headers = [(b"content-type", content_type)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _wait_for_observations(out: Path, num: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        journal = out / "journal.jsonl"
        if journal.exists() and journal.read_text().count('"type":"observation"') >= num:
            return
        time.sleep(0.02)
    raise AssertionError(f"the repro ended, or observed fewer than {num} requests in 120 s")

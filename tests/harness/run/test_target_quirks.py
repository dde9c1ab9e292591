"""What real engines do that a run must take in its stride, end to end through the CLI:
a `/health` route that stalls while every request is answered (llama.cpp under load), a
usage count in another tokenizer (a vLLM model's, counted with cl100k_base), a base URL
given the OpenAI way (`.../v1`), and the user mistakes that must be one line and exit 2
(credentials in the URL, a port past 65535, values that would overflow or allocate
gigabytes) or one line that says what failed (a refused connection).

The fake target counts prompt tokens in cl100k_base (times `scale`, plus `offset`: a BOS, a
template), rejects prompts at or above its pool by that count with 400 and answers the rest
at once, with usage."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import fake_openai as fake
import pytest
from misbehaving_server import serve

from kvcanary.harness.cli import main


def fake_target(*, stall_health_s: float = 0.0, scale: float = 1.0, offset: int = 0) -> Any:
    """A safe target; with `stall_health_s`, its `/health` answers the first poll at once
    and every later one only after that long; its usage counts `scale` times the prompt's
    cl100k tokens, plus `offset`."""
    num_health = 0

    async def app(scope: fake.Scope, receive: fake.Receive, send: fake.Send) -> None:
        nonlocal num_health
        body = await fake.read_body(receive)
        if scope["method"] == "GET":
            if scope["path"] == "/health":
                num_health += 1
                if num_health > 1:
                    await asyncio.sleep(stall_health_s)
                await fake.json_response(send, 200, {"status": "ok"})
            else:
                await fake.models_or_404(scope, send)
            return
        request = json.loads(body)
        num_tokens = int(fake.num_prompt_tokens(request) * scale) + offset  # as it counts them
        if num_tokens >= fake.POOL:
            await fake.json_response(send, 400, {"error": {"message": "too long"}})
            return
        await fake.answer(
            send, request, {"prompt_tokens": num_tokens, "completion_tokens": 1}, " word"
        )

    return app


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


def test_a_stalling_health_route_while_requests_complete_is_recorded_and_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its `/health` sleeps 10 s from the second poll on; every request is answered at
    once: the run is clean, exit 0, and the route's failure is on record."""
    out = tmp_path / "run"
    argv = ["run", *fake.LIMIT_FLAGS, "--rate", "20", "--requests", "180", "--health-timeout", "1s"]
    with serve(fake_target(stall_health_s=10.0)) as url:
        status = main([*argv, "--target", url, "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 0, printed.err[-2000:]
    assert printed.out.startswith("verdict: CLEAN")
    journal = rows(out)
    (recorded,) = [r for r in journal if r["type"] == "health_route_failed"]
    assert recorded["last_error"] == "GET /health: no answer within 1 s"
    assert recorded["num_polls"] == 2
    assert not [r for r in journal if r["type"] == "target_unhealthy"]
    assert "the target's health route failed 2 polls in a row" in printed.err
    assert "stopped serving" not in printed.err + printed.out


def test_a_usage_count_that_grows_differently_with_length_is_exit_2_naming_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a vLLM model counted with cl100k_base looks like: never a finding, one line."""
    out = tmp_path / "run"
    with serve(fake_target(scale=1.3, offset=2)) as url:
        status = main(["run", *fake.LIMIT_FLAGS, "--target", url, "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 2, printed.err[-2000:]
    (line,) = [line for line in printed.err.splitlines() if line.startswith("kvcanary:")]
    assert "--tokenizer PATH/tokenizer.json" in line
    assert "counts prompts differently from --tokenizer cl100k_base" in line
    assert printed.err.strip().endswith(line)
    assert "Traceback" not in printed.err
    assert not (out / "journal.jsonl").exists()  # nothing was sent, nothing is judged


def test_a_constant_offset_is_calibrated_away_and_a_v1_base_url_is_the_server_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["run", *fake.LIMIT_FLAGS, "--requests", "40", "--concurrency", "4"]
    with serve(fake_target(offset=6)) as url:
        status = main([*argv, "--target", f"{url}/v1/", "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 0, printed.err[-2000:]
    assert printed.err.count(f"target: using {url} (the server's root; kvcanary adds /v1)") == 1
    assert "calibration: completions: the server counts +6 token(s) on every prompt" in printed.err
    started = rows(out)[0]
    assert started["target"] == url
    assert started["settings"]["prompt_token_offset"]["offset"] == 6


def test_a_refused_connection_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    status = main(["run", "--target", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 3
    assert err[-1].endswith(f"unreachable: connection refused (127.0.0.1:{port})")
    assert "Timeout" not in err[-1]


@pytest.mark.parametrize("backend", ["aiohttp", "httpx"])
def test_credentials_in_the_target_url_are_refused_and_never_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    secret = "PASSWORDx9f2"
    out = tmp_path / "run"
    url = f"http://user:{secret}@127.0.0.1:9/v1"
    with pytest.raises(SystemExit) as stopped:
        main(["run", "--target", url, "--http-backend", backend, "--out", str(out)])
    printed = capsys.readouterr()
    assert stopped.value.code == 2
    assert secret not in printed.out + printed.err
    (line,) = printed.err.strip().splitlines()
    assert "the URL carries credentials" in line
    assert "--api-key-env VAR" in line
    assert not out.exists()


@pytest.mark.parametrize("command", ["run", "audit"])
def test_a_port_past_65535_is_a_usage_error_in_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command, "--target", "http://127.0.0.1:99999"]
    try:
        status = main([*argv, *(["--out", str(tmp_path / "r")] if command == "run" else [])])
    except SystemExit as exc:  # argparse's own usage error
        status = int(exc.code or 0)
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1
    assert "not a usable URL (a port of 1-65535 and a host)" in err


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("rate = 1e-300", "rate: expected a number from 0.001 to 100000, got '1e-300'"),
        ("tenants = 100000000000", "tenants: expected a whole number from 1 to 256"),
        ("requests = 10000000000", "requests: expected a whole number from 1 to 4,194,304"),
        ("duration = '1000000000h'", "duration: a duration must be at most 366d"),
        ("context-tokens = 100000000000", "context-tokens: expected a whole number from 1"),
    ],
)
def test_values_past_their_bounds_are_refused_before_anything_is_allocated(
    setting: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvcanary.toml"
    config.write_text(f"[run]\n{setting}\n")
    status = main(["run", "--config", str(config), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert status == 2
    (line,) = err.splitlines()
    assert message in line

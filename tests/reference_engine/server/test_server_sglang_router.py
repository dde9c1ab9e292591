"""The real sglang-router (PyPI `sglang-router`, SGLang's Rust router) in front of the engine.

The engine runs as separate processes (`running_engine(processes=True)`, what `kvcanary
serve --processes` runs); the router is started as a user would:

    python -m sglang_router.launch_router --pd-disaggregation \\
        --prefill PREFILL_URL BOOTSTRAP_PORT --decode DECODE_URL --host 127.0.0.1 --port P

and `kvcanary run --target ROUTER_URL` goes through it. The router relays decode's body, so
the over-pool probes the vulnerable engine answers carry decode's usage (the real prompt
length), and the leak must be found by content; the patched engine must come out clean, its
400s reaching the client once each (a 4xx is not retried). The test skips, saying why, only
when the router itself cannot start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcanary.harness.cli import main
from kvcanary.reference_engine.server.launch import EngineHandle, running_engine

pytestmark = pytest.mark.slow

CONTEXT = 1024  # prefill pool 656 tokens on both presets
STARTUP_DEADLINE_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def sglang_router(engine: EngineHandle, log: Path) -> Iterator[str]:
    """The real router in front of `engine`'s prefill and decode servers; yields its URL."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install sglang-router)")
    port = free_port()
    command = [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", engine.urls["prefill"], str(engine.bootstrap_port),
        "--decode", engine.urls["decode"],
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        router = subprocess.Popen(command, stdout=out, stderr=out)
    try:
        _wait_until_serving(router, url, log)
        yield url
    finally:
        router.terminate()
        try:
            router.wait(timeout=30)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()


def _wait_until_serving(router: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Until the router lists the engine's model (it registered both workers)."""
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while time.monotonic() < deadline:
        if router.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:]
            status = router.returncode
            pytest.skip(f"the sglang-router binary could not start (exit {status}): {tail}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            models = httpx.get(f"{url}/v1/models", timeout=5).json()
            if any(m.get("id") == "kvcanary-reference" for m in models.get("data", [])):
                return
        time.sleep(0.2)
    raise AssertionError(f"sglang-router did not register the engine in {STARTUP_DEADLINE_S:g} s")


def run_through(url: str, out: Path) -> int:
    return main([
        "run", "--target", url, "--out", str(out), "--requests", "40", "--seed", "11",
        "--pool-tokens", "656", "--context-tokens", str(CONTEXT), "--page-size", "16",
    ])  # fmt: skip


def journal(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


def requests_by_code(engine: EngineHandle, role: str) -> dict[str, float]:
    """`sglang:num_requests_total` per status code, as one side counted them."""
    counts = {}
    for line in httpx.get(f"{engine.urls[role]}/metrics", timeout=30).text.splitlines():
        if line.startswith("sglang:num_requests_total{"):
            code = line.split('code="')[1].split('"')[0]
            counts[code] = float(line.split()[-1])
    return counts


def test_native_routes_answer_through_the_real_router(tmp_path: Path) -> None:
    with (
        running_engine("vulnerable", processes=True, context_length=CONTEXT) as engine,
        sglang_router(engine, tmp_path / "router.log") as url,
    ):
        assert engine.bootstrap_port > 0
        text = {"text": "hello there friend", "sampling_params": {"max_new_tokens": 4}}
        ids = {"input_ids": [791, 4062, 14198], "sampling_params": {"max_new_tokens": 4}}
        for body in (text, ids):
            r = httpx.post(f"{url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["completion_tokens"] == 4
        info = httpx.get(f"{url}/get_model_info", timeout=30).json()
        assert info["model_path"] == "kvcanary-reference"
        too_long = {"model": "kvcanary-reference", "prompt": "hello " * 1100, "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=too_long, timeout=120)
        assert r.status_code == 400
        assert "context length" in r.text
        assert requests_by_code(engine, "decode").get("400") == 1.0  # a 4xx is not retried


def test_kvcanary_through_the_real_router_finds_the_vulnerable_leak_by_content(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    with (
        running_engine("vulnerable", processes=True, context_length=CONTEXT) as engine,
        sglang_router(engine, tmp_path / "router.log") as url,
    ):
        status = run_through(url, out)
    printed = capsys.readouterr().out
    assert status == 1, printed
    assert printed.startswith("verdict: LEAK")
    rows = journal(out)
    findings = [r["kind"] for r in rows if r["type"] == "finding"]
    assert "cross_tenant_canary" in findings
    assert "prompt_tokens_mismatch" not in findings  # the router relays decode's usage
    plans = {r["request_id"]: r for r in rows if r["type"] == "plan"}
    answered_probes = [
        r
        for r in rows
        if r["type"] == "observation"
        and r["status"] == 200
        and plans[r["request_id"]]["expected"] == "reject"
    ]
    assert answered_probes, "no over-pool probe was answered"
    for obs in answered_probes:  # the incident's client view: a 200 with the right count
        assert obs["usage"]["prompt_tokens"] == plans[obs["request_id"]]["num_prompt_tokens"]


def test_kvcanary_through_the_real_router_finds_the_patched_engine_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    with (
        running_engine("patched", processes=True, context_length=CONTEXT) as engine,
        sglang_router(engine, tmp_path / "router.log") as url,
    ):
        status = run_through(url, out)
        decode_codes = requests_by_code(engine, "decode")
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert printed.startswith("verdict: CLEAN")
    rows = journal(out)
    refused = [r for r in rows if r["type"] == "observation" and r["status"] == 400]
    assert refused, "no over-limit prompt was refused"
    assert decode_codes.get("400") == len(refused)  # each reached decode once: no retries

"""Against a disaggregated vLLM: one prefill and one decode server (CPU build, prefix caching
on) sharing KV through vLLM's ExampleConnector, behind `pd_proxy.py`. The decode server
reports the KV it loaded from prefill as `cached_tokens` on every request, a fresh prompt's
included; kvcanary must not take that for a cache shared across tenants:

- the proxy relays prefill-then-decode, streamed and not, completions and chat;
- a run is clean, with completions and with chat;
- the cache probe with a salt per tenant finds nothing across tenants, whether decode
  computed the probe's prompts itself or loaded them from prefill.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer
from vllm_support import (
    BLOCK_SIZE,
    PROBE_ARGS,
    SERVED_MODEL,
    WORKLOAD_ARGS,
    KvcanaryRun,
    PdDeployment,
    assert_clean_with_the_engines_limits,
    kvcanary_run,
)

# the first test's timeout covers its module's server start (25-50 s idle, minutes loaded)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _body(api: str, text: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_MODEL, "max_tokens": 4, "stream": stream}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_the_proxy_serves_each_request_from_the_kv_prefill_computed(
    pd_deployment: PdDeployment, api: str, stream: bool
) -> None:
    """A fresh prompt (nothing cached anywhere) is answered by decode with its tokens but
    the last, rounded down to whole blocks, reported cached: the KV that prefill saved and
    decode loaded."""
    route = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    with httpx.Client(base_url=pd_deployment.url, timeout=120.0) as http:
        body = _loadable_body(http, api, stream)
        answer = http.post(route, json=body)
        assert answer.status_code == 200, answer.text
        if stream:
            assert answer.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            usage = json.loads(events[-2])["usage"]
            assert len(events) >= 3  # text, usage, [DONE]
        else:
            usage = answer.json()["usage"]
    assert usage["completion_tokens"] == 4
    whole_blocks = (usage["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert usage["prompt_tokens_details"]["cached_tokens"] == whole_blocks, usage


def _loadable_body(http: httpx.Client, api: str, stream: bool) -> dict[str, Any]:
    """A fresh request whose KV ExampleConnector finds: it saves a prompt of n tokens under
    its first (n - 1) // 32 * 32 tokens and looks it up under (n - 2) // 32 * 32, so a
    prompt of 32k + 1 tokens is never found (the tokens are counted by the deployment's
    /tokenize, the chat template's included)."""
    text = f" {secrets.token_hex(8)}" + " the quiet river ran past the old mill" * 40
    while True:
        body = _body(api, text, stream)
        prompt = {k: body[k] for k in ("model", "prompt", "messages") if k in body}
        counted = http.post("/tokenize", json=prompt)
        assert counted.status_code == 200, counted.text
        if counted.json()["count"] % BLOCK_SIZE != 1:
            return body
        text += " river"


def test_the_proxy_relays_a_refusal_and_forwards_other_routes_to_decode(
    pd_deployment: PdDeployment, tiny_llama: Path
) -> None:
    text = " the quiet river ran past the old mill"
    with httpx.Client(base_url=pd_deployment.url, timeout=120.0) as http:
        too_long = http.post("/v1/completions", json=_body("completions", text * 300, False))
        assert too_long.status_code == 400, too_long.text
        assert "context length" in too_long.text or "maximum" in too_long.text, too_long.text
        answered = http.post("/v1/completions", json=_body("completions", text, False))
        assert answered.status_code == 200, answered.text
        [model] = http.get("/v1/models").json()["data"]
        assert (model["id"], model["max_model_len"]) == (SERVED_MODEL, 2048)
        counted = http.post("/tokenize", json={"model": SERVED_MODEL, "prompt": text}).json()
        local = Tokenizer.from_file(str(tiny_llama / "tokenizer.json")).encode(text)
        assert counted["tokens"] == local.ids  # BOS included
        # decode generated 4 tokens a request, prefill 1: the proxy's /metrics are decode's
        generated = {
            name: _generation_tokens(http.get(f"{url}/metrics").text)
            for name, url in [
                ("proxy", pd_deployment.url),
                ("decode", pd_deployment.decode.url),
                ("prefill", pd_deployment.prefill.url),
            ]
        }
    assert generated["proxy"] == generated["decode"] > generated["prefill"], generated


def _generation_tokens(metrics: str) -> float:
    [line] = [m for m in metrics.splitlines() if m.startswith("vllm:generation_tokens_total")]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_run_is_clean(
    pd_deployment: PdDeployment,
    tiny_llama: Path,
    tmp_path: Path,
    api: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--target", pd_deployment.url, "--tokenizer", str(tiny_llama / "tokenizer.json")]
    run = kvcanary_run(
        [*argv, "--api", api, *WORKLOAD_ARGS, "--seed", "21"], tmp_path / "run", capsys
    )
    assert_clean_with_the_engines_limits(run)  # decode's, through the proxy


def _salted_probe(
    url: str, tokenizer: Path, api: str, out: Path, capsys: pytest.CaptureFixture[str]
) -> KvcanaryRun:
    argv = ["--target", url, "--tokenizer", str(tokenizer), "--api", api, "--seed", "22"]
    run = kvcanary_run([*argv, *PROBE_ARGS, "--cache-probe-salts"], out, capsys)
    assert run.summary, run.err[-2000:]
    assert run.contrasts("cross_tenant") == [], run.out
    assert "shared_prefix_cache" not in run.probe_finding_kinds, run.out
    return run


def test_with_a_salt_per_tenant_the_probe_finds_nothing_across_tenants(
    pd_deployment: PdDeployment,
    tiny_llama: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Completions prompts of the probe's 1,024 tokens are 1,025 with BOS, a length whose KV
    ExampleConnector saves under another key than it looks up (it aligns `n` and `n - 1`
    down to a block): decode computes them itself, its prefix cache is the one the probe
    sees, and the probe decides."""
    url, tokenizer = pd_deployment.url, tiny_llama / "tokenizer.json"
    run = _salted_probe(url, tokenizer, "completions", tmp_path / "run", capsys)
    misses = run.usages("cache_probe/miss")
    assert misses, run.err[-2000:]
    assert {usage["cached_tokens"] for usage in misses} == {0}, misses  # the premise
    [probe] = run.summary["probes"]
    assert probe["verdict"] != "inconclusive", probe
    assert run.status in (0, 1), run.err[-2000:]  # 1: a spoofed salt is read (not bound)


def test_kv_that_decode_loaded_from_prefill_is_no_evidence_of_a_shared_cache(
    pd_deployment: PdDeployment,
    tiny_llama: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Chat prompts of 1,024 tokens (the template's BOS included) are loaded by decode from
    what prefill saved, and it reports them as cached on every arm, the miss control's
    included: only what an arm's count exceeds its miss control by is evidence, so no
    tenant is said to read another's cache. Where timing cannot tell the arms apart either,
    the probe and the run are inconclusive, never a leak."""
    url, tokenizer = pd_deployment.url, tiny_llama / "tokenizer.json"
    run = _salted_probe(url, tokenizer, "chat", tmp_path / "run", capsys)
    misses = run.usages("cache_probe/miss")
    assert misses, run.err[-2000:]
    assert all(u["cached_tokens"] >= u["prompt_tokens"] - 32 for u in misses), misses
    [probe] = run.summary["probes"]
    assert probe["verdict"] != "leak", probe
    if probe["verdict"] == "inconclusive":
        assert run.status == 3, run.err[-2000:]
    else:
        assert run.status in (0, 1), run.err[-2000:]

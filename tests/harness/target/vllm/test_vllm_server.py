"""Against one real vLLM server (CPU build, prefix caching on, a tiny random Llama): kvcanary
runs as a user runs it, and its verdicts hold. vLLM keeps tenants' KV apart except through
its prefix cache, which every client shares unless requests carry a `cache_salt`:

- a run is clean with completions and with chat, its limits read from the engine (the KV
  pool of 4,096 tokens from `/metrics`, the context of 2,048 from `/v1/models`);
- what kvcanary assumes vLLM does with a prompt that fits the context while prompt +
  max_tokens does not is what it does;
- without `--tokenizer` a run is clean or stops naming `--tokenizer`, never a finding;
- the cache probe finds the unsalted shared cache; with a salt per tenant it finds nothing
  across tenants, and it reports that a tenant sending another's salt reads its cache.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer
from vllm_support import (
    CONTEXT_TOKENS,
    PROBE_ARGS,
    SERVED_MODEL,
    WORKLOAD_ARGS,
    VllmServer,
    assert_clean_with_the_engines_limits,
    kvcanary_run,
)

from kvcanary.harness.target.limits import discover_limits

# the first test's timeout covers its module's server start (25-50 s idle, minutes loaded)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_run_is_clean_with_limits_read_from_the_engine(
    vllm_server: VllmServer,
    tiny_llama: Path,
    tmp_path: Path,
    api: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--target", vllm_server.url, "--tokenizer", str(tiny_llama / "tokenizer.json")]
    run = kvcanary_run(
        [*argv, "--api", api, *WORKLOAD_ARGS, "--seed", "11"], tmp_path / "run", capsys
    )
    assert_clean_with_the_engines_limits(run)
    assert "context: openai:/v1/models" in run.summary["limits"]["source"]
    requests = run.summary["counts"]["requests"]
    assert requests["rejected"] > 0, requests  # the prompts past the context: vLLM's 400
    assert requests["accepted"] > 0, requests


async def test_the_convention_assumed_for_vllm_is_what_vllm_does(
    vllm_server: VllmServer, tiny_llama: Path
) -> None:
    """A prompt that fits the context while prompt + max_tokens does not is judged by the
    convention kvcanary assumes for the engine it identified (`Limits.max_tokens_policy`):
    the real engine's answer must be that convention, or every clean run reports it."""
    text = " the" * (CONTEXT_TOKENS - 2)
    local = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    assert len(local.encode(text).ids) == CONTEXT_TOKENS - 1  # BOS included
    body = {"model": SERVED_MODEL, "prompt": text, "max_tokens": 16}
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120.0) as http:
        answer = await http.post("/v1/completions", json=body)
        limits = await discover_limits(
            http, vllm_server.url, pool_tokens=None, context_tokens=None, page_size=None
        )
        too_long = await http.post("/v1/completions", json={**body, "prompt": text + " the"})
    assert too_long.status_code == 400, too_long.text  # the prompt alone fills the context
    if answer.status_code == 200:
        [choice] = answer.json()["choices"]
        assert choice["finish_reason"] == "length", choice
        assert answer.json()["usage"]["completion_tokens"] == 1  # until the context is full
        observed = "stop"
    else:
        assert answer.status_code == 400, answer.text
        observed = "reject"
    assert limits.max_tokens_policy == observed, answer.text[:300]


def test_a_run_without_a_tokenizer_is_clean_or_names_the_option(
    vllm_server: VllmServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a new user types first. vLLM serves `/tokenize`, so the run may count with it
    (and says so), or stop in one line naming `--tokenizer`; never a finding: a wrong
    tokenizer is not a leak."""
    argv = ["--target", vllm_server.url, *WORKLOAD_ARGS, "--seed", "12"]
    run = kvcanary_run(argv, tmp_path / "run", capsys)
    assert run.findings == [], run.out
    assert "Traceback" not in run.err
    if run.status == 2:
        last_line = run.err.strip().splitlines()[-1]  # after the progress lines
        assert "--tokenizer" in last_line, run.err[-2000:]
    else:
        assert (run.status, run.out.splitlines()[0][:14]) == (0, "verdict: CLEAN"), run.err
        assert "tokenize" in run.err, run.err[-2000:]  # which tokenizer counted is said


def test_the_cache_probe_finds_the_unsalted_prefix_cache_shared_across_tenants(
    vllm_server: VllmServer, tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--target", vllm_server.url, "--tokenizer", str(tiny_llama / "tokenizer.json")]
    run = kvcanary_run([*argv, *PROBE_ARGS, "--seed", "13"], tmp_path / "run", capsys)
    assert run.status == 1, run.err[-2000:]
    [probe] = run.summary["probes"]
    assert (probe["probe"], probe["verdict"]) == ("cache_probe", "leak"), probe
    assert run.probe_finding_kinds == {"shared_prefix_cache"}, run.out
    # both ordered pairs of the 2 tenants; vLLM reports the hits itself (cached_tokens)
    assert len(run.contrasts("cross_tenant")) == 2, run.out
    for finding in run.contrasts("cross_tenant"):
        assert finding["details"]["contrast"]["reported"]["says_hit"], finding


def test_with_a_salt_per_tenant_the_probe_finds_nothing_across_tenants_but_a_spoofed_salt(
    vllm_server: VllmServer, tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM keys its prefix cache by `cache_salt`, so tenants with their own salts share
    nothing; but the salt is whatever the client sends, so a tenant that sends another's
    salt is served from that tenant's cache: a finding of its own (the salt is not bound to
    the credential), not a cache shared by everyone."""
    argv = ["--target", vllm_server.url, "--tokenizer", str(tiny_llama / "tokenizer.json")]
    argv += [*PROBE_ARGS, "--cache-probe-salts", "--seed", "14"]
    run = kvcanary_run(argv, tmp_path / "run", capsys)
    assert run.summary, run.err[-2000:]
    assert run.contrasts("cross_tenant") == [], run.out
    assert "shared_prefix_cache" not in run.probe_finding_kinds, run.out
    assert run.probe_finding_kinds == {"cache_salt_not_bound"}, run.out
    assert len(run.probe_findings) == 2, run.out  # each tenant read the other's cache
    assert run.status == 1, run.err[-2000:]

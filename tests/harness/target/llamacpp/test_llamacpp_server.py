"""Against llama.cpp's real server (xllamacpp) serving tiny GGUF models: its tokenize
convention is detected and counts like the model's own tokenizer.json, its limits are read
without flags, `kvcanary audit` reads its n_ctx, and its BOS token is calibrated away."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from llamacpp_support import N_CTX_PER_SLOT, LlamaServer

from kvcanary.canaries import RemoteTokenizer, load_tokenizer
from kvcanary.harness.cli import main
from kvcanary.harness.detectors.protocol import ProtocolDetector
from kvcanary.harness.target.calibration import measure_prompt_token_offset
from kvcanary.harness.target.client import TargetClient
from kvcanary.harness.target.limits import discover_limits
from kvcanary.harness.target.tokenizer import remote_tokenizer
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant

TENANT = Tenant(name="tenant-0")
TEXTS = (
    " The river was quiet and the function returns a value.",
    " ydk apple orbit 12345, naïve café — ok?",
    " x",
)


async def test_tokenizer_server_detects_llamacpp_and_counts_like_the_model(
    llama_server: LlamaServer,
) -> None:
    local = load_tokenizer(str(llama_server.model.tokenizer_json))
    async with httpx.AsyncClient(timeout=30.0) as http:
        remote = await remote_tokenizer(http, llama_server.url, "m", TENANT)
        assert remote.style == "llamacpp"
        for text in TEXTS:
            assert await remote.encode(text) == local.encode(text), text
            assert await remote.count(text) == local.count(text)
        if llama_server.model.vocabulary == "bytes":
            assert await remote.count(TEXTS[0]) == len(TEXTS[0].encode())


async def test_the_others_conventions_are_refused_by_name(bpe_server: LlamaServer) -> None:
    # what kvcanary used to send llama.cpp: {"prompt": ...}, answered 200 {"tokens": []}
    async with httpx.AsyncClient(timeout=30.0) as http:
        remote = RemoteTokenizer(http, bpe_server.url, style="vllm")
        with pytest.raises(Exception, match=rf"{bpe_server.url}/tokenize counted 0 tokens"):
            await remote.detect()


async def test_limits_are_read_without_flags(llama_server: LlamaServer) -> None:
    async with httpx.AsyncClient(timeout=30.0) as http:
        limits = await discover_limits(
            http, llama_server.url, pool_tokens=None, context_tokens=None, page_size=None
        )
    assert (limits.pool_tokens, limits.context_tokens) == (N_CTX_PER_SLOT, N_CTX_PER_SLOT)
    assert limits.page_size == 16
    assert "pool: llamacpp:/props" in limits.source
    assert "context: llamacpp:/v1/models meta.n_ctx" in limits.source


def test_audit_reads_n_ctx(bpe_server: LlamaServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--target", bpe_server.url, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["engine"] == "llamacpp"
    assert record["context_tokens"] == N_CTX_PER_SLOT
    (side,) = record["sides"]
    assert (side["pool_tokens"], side["verdict"], side["source"]) == (
        N_CTX_PER_SLOT,
        "ok",
        "llamacpp:/props",
    )
    assert {f["name"]: f["source"] for f in record["figures"]} == {
        "context_tokens": "read: llamacpp:/v1/models meta.n_ctx",
        "pool_tokens": "read: llamacpp:/props",
    }


async def test_the_bos_token_is_calibrated_so_an_exact_prompt_is_not_a_mismatch(
    bpe_server: LlamaServer,
) -> None:
    local = load_tokenizer(str(bpe_server.model.tokenizer_json))
    prompt = TEXTS[0] * 8
    plan = RequestPlan(
        request_id="t0-r000001",
        tenant=TENANT.name,
        phase="fill",
        intent="victim",
        size_label="fill",
        num_prompt_tokens=local.count(prompt),
        expected="accept",
        api="completions",
        prompt=prompt,
        max_tokens=2,
    )
    async with httpx.AsyncClient(timeout=60.0) as http:
        async with httpx.AsyncClient(timeout=30.0) as info:
            limits = await discover_limits(
                info, bpe_server.url, pool_tokens=None, context_tokens=None, page_size=None
            )
        measured = await measure_prompt_token_offset(
            http, bpe_server.url, "m", "completions", local, TENANT
        )
        obs = await TargetClient(http, bpe_server.url, model="m").send(
            plan, TENANT, t_scheduled_ns=0
        )
    assert measured.offset == 1  # llama.cpp prepends BOS to every completions prompt
    assert obs.ok, obs.error
    assert obs.usage.prompt_tokens == plan.num_prompt_tokens + 1
    assert ProtocolDetector(limits).check(plan, obs) != []  # what every answer used to be
    calibrated = ProtocolDetector(limits, prompt_token_offsets={"completions": measured.offset})
    assert calibrated.check(plan, obs) == []


def test_audit_probe_is_counted_by_llamacpp_and_refused(
    bpe_server: LlamaServer, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["audit", "--target", bpe_server.url, "--probe", "--json"])
    probe = json.loads(capsys.readouterr().out)["probe"]
    assert probe["token_count"] == "exact (server /tokenize)"
    assert probe["num_tokens"] > N_CTX_PER_SLOT
    assert (probe["outcome"], probe["status"], status) == ("rejected", 400, 0)


@pytest.mark.parametrize("tokenizer", ["server", "path"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_run_against_llamacpp_is_clean(
    bpe_server: LlamaServer,
    tmp_path: Path,
    api: str,
    tokenizer: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """llama.cpp keeps each slot's KV to itself: the run must find nothing, BOS included,
    counting with the server's tokenize route or with the model's own tokenizer.json (the
    byte-level model: `test_a_byte_level_model_runs_clean_with_a_stated_window`)."""
    llama_server = bpe_server
    out = tmp_path / "run"
    counter = "server" if tokenizer == "server" else str(llama_server.model.tokenizer_json)
    argv = ["run", "--target", llama_server.url, "--tokenizer", counter, "--api", api]
    argv += ["--page-size", "80", "--requests", "40", "--concurrency", "2", "--seed", "3"]
    status = main([*argv, "--out", str(out)])
    printed = capsys.readouterr()
    assert (out / "summary.json").exists(), printed.err[-600:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["counts"]["findings_total"] == 0, summary["counts"]["findings"]
    assert status == 0, printed.out
    assert printed.out.startswith("verdict: CLEAN")
    assert "calibration: " in printed.err


@pytest.mark.parametrize("llama_server", ["bytes"], indirect=True)
def test_a_byte_level_model_runs_clean_with_a_stated_window(
    llama_server: LlamaServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Canaries of a byte-level vocabulary are too long to be attributed per 80-token page:
    the run laces for the densest window, says so once, records it, and is clean; with
    --strict-page-size the same run is refused in one line."""
    out = tmp_path / "run"
    argv = ["run", "--target", llama_server.url, "--api", "completions", "--page-size", "80"]
    argv += ["--tokenizer", str(llama_server.model.tokenizer_json)]
    argv += ["--requests", "16", "--concurrency", "2", "--seed", "5"]
    status = main([*argv, "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 0, printed.err[-600:]
    assert printed.out.startswith("verdict: CLEAN")
    [note] = [line for line in printed.err.splitlines() if "canaries: every " in line]
    assert "pages of 80 tokens are not individually attributable" in note
    started = json.loads((out / "journal.jsonl").read_text().splitlines()[0])
    canaries = started["canaries"]
    assert canaries["page_size"] == 80
    assert not canaries["per_page"]
    assert canaries["guaranteed_window"] == 2 * canaries["canary_tokens"] - 1 > 80
    assert f"every {canaries['guaranteed_window']}-token window" in note
    summary = json.loads((out / "summary.json").read_text())
    assert summary["canaries"]["guarantee"] == canaries["guarantee"]

    status = main([*argv, "--strict-page-size", "--out", str(tmp_path / "strict")])
    printed = capsys.readouterr()
    assert status == 2
    [line] = printed.err.strip().splitlines()
    assert line.startswith("kvcanary: error: --page-size 80: ")
    assert "at least 91 tokens" in line
    assert "--strict-page-size" in line
    assert "Traceback" not in printed.err


def test_the_cache_probe_finds_llamacpps_prompt_cache_shared_across_tenants(
    bpe_server: LlamaServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama.cpp reuses a slot's cached prompt for whoever sends the same prefix next (it has
    no notion of tenants) and reports it in `cached_tokens`: the probe says so for every
    tenant pair, while the workload before it finds no canary (its prompts never share a
    prefix). Its prompts are laced for the tokenizer's own canaries."""
    out = tmp_path / "run"
    argv = ["run", "--target", bpe_server.url, "--tokenizer", "server", "--api", "completions"]
    argv += ["--page-size", "80", "--requests", "4", "--concurrency", "1", "--seed", "4"]
    argv += ["--profile", "below", "--cache-probe", "--cache-probe-trials", "8"]
    status = main([*argv, "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 1, printed.err[-2000:]
    assert "Traceback" not in printed.err
    summary = json.loads((out / "summary.json").read_text())
    [probe] = summary["probes"]
    assert (probe["probe"], probe["verdict"]) == ("cache_probe", "leak")
    assert len(probe["reasons"]) == 4  # the ring of 4 tenant pairs
    assert all("served from cache" in reason for reason in probe["reasons"])
    rows = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in rows if r["type"] == "finding"}
    assert kinds == {"shared_prefix_cache"}


@pytest.mark.slow
def test_without_tokenizer_a_run_on_a_busy_machine_counts_with_llamacpps_own_and_is_clean(
    bpe_server: LlamaServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    cpu_burner_per_core: int,
) -> None:
    """No --tokenizer: the server's tokenize route counts, said once; a CPU burner per core
    slows every slot (and llama.cpp's `/health` with them): still every request answered,
    so clean, never "the target stopped serving"."""
    out = tmp_path / "run"
    argv = ["run", "--target", bpe_server.url, "--page-size", "80", "--requests", "40"]
    argv += ["--concurrency", "2", "--seed", "6", "--out", str(out)]
    status = main(argv)
    printed = capsys.readouterr()
    assert status == 0, printed.err[-2000:]
    assert printed.out.startswith("verdict: CLEAN")
    [said] = [line for line in printed.err.splitlines() if "tokenizer: " in line]
    assert f"tokenizer: the target's own, {bpe_server.url}/tokenize (llamacpp)" in said
    assert "stopped serving" not in printed.err
    assert "calibration: completions: the server counts +1 token(s) on every prompt" in (
        printed.err
    )
    rows = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["type"] in ("target_unhealthy", "finding")]


def test_a_tokenizer_that_is_not_the_models_is_exit_2_naming_tokenizer(
    bpe_server: LlamaServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """cl100k_base against the tiny model's own BPE: its counts drift with the length, which
    no offset corrects. One line, exit 2, and not one finding."""
    out = tmp_path / "run"
    argv = ["run", "--target", bpe_server.url, "--tokenizer", "cl100k_base"]
    status = main([*argv, "--requests", "8", "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 2, printed.err[-2000:]
    [line] = [line for line in printed.err.splitlines() if line.startswith("kvcanary: ")]
    assert "--tokenizer PATH/tokenizer.json" in line
    assert "Traceback" not in printed.err
    assert not (out / "journal.jsonl").exists()

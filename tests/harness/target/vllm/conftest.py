"""The real vLLM (CPU build, its own venv from `scripts/vllm-env`) serving a tiny random Llama:
one server per test module, or one prefill/decode pair behind `pd_proxy.py`, on free
loopback ports, stopped after the module. Every test here is marked `slow` (a server takes
25-50 s to start) and skips, naming the script, where the venv is missing."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_support import (
    PD_ARGS,
    PdDeployment,
    PdProxy,
    VllmServer,
    kv_transfer_config,
    skip_reason,
    tiny_model,
    vllm_python,
)


@pytest.fixture(scope="session")
def vllm_venv_python() -> Path:
    python = vllm_python()
    if python is None:
        pytest.skip(skip_reason())
    return python


@pytest.fixture(scope="session")
def tiny_llama(vllm_venv_python: Path) -> Path:
    """The tiny model's folder (`config.json`, `model.safetensors`, `tokenizer.json`, ...)."""
    return tiny_model(vllm_venv_python)


@pytest.fixture(scope="module")
def vllm_server(
    vllm_venv_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """One vLLM server, its OpenMP threads on core 0 (a PD pair in another test worker takes
    core 0 for prefill and core 1 for decode)."""
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    server = VllmServer(vllm_venv_python, tiny_llama, log, omp_bind="0")
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pd_deployment(
    vllm_venv_python: Path, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PdDeployment]:
    """1 prefill + 1 decode server sharing KV through ExampleConnector, behind the proxy.
    The connector never deletes what it stores: its folder is a temporary one, removed after
    the module."""
    logs = tmp_path_factory.mktemp("vllm-pd-log")
    storage = tmp_path_factory.mktemp("vllm-pd-kv")
    servers = [
        VllmServer(
            vllm_venv_python,
            tiny_llama,
            logs / f"{role}.log",
            omp_bind=core,
            extra_args=(*PD_ARGS, f"--kv-transfer-config={kv_transfer_config(role, storage)}"),
        )
        for role, core in (("kv_producer", "0"), ("kv_consumer", "1"))
    ]
    try:
        for server in servers:  # both start at once: startup is mostly imports and spawning
            server.start()
        for server in servers:
            server.wait_ready()
        prefill, decode = servers
        proxy = PdProxy(prefill.url, decode.url, logs / "proxy.log")
        try:
            yield PdDeployment(proxy.url, prefill, decode)
        finally:
            proxy.stop()
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(storage, ignore_errors=True)

"""llama.cpp's real server (PyPI `xllamacpp`) serving the tiny GGUF models of `tiny_gguf`,
started by the tests on a free loopback port and stopped after them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from llamacpp_support import N_CTX, N_PARALLEL, SERVE_SCRIPT, START_DEADLINE_S, LlamaServer
from stdin_child import stop_stdin_child
from tiny_gguf import TinyModel, build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    directory = tmp_path_factory.mktemp("gguf")
    return {v: build_tiny_model(directory, v) for v in ("bpe", "bytes")}


@pytest.fixture(scope="module", params=["bpe", "bytes"])
def llama_server(
    request: pytest.FixtureRequest,
    tiny_models: dict[str, TinyModel],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LlamaServer]:
    model = tiny_models[request.param]
    with _serving(model, tmp_path_factory.mktemp("llamacpp-log") / "server.log") as url:
        yield LlamaServer(url, model)


@pytest.fixture(scope="module")
def bpe_server(
    tiny_models: dict[str, TinyModel], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    model = tiny_models["bpe"]
    with _serving(model, tmp_path_factory.mktemp("llamacpp-log") / "server.log") as url:
        yield LlamaServer(url, model)


@pytest.fixture
def cpu_burner_per_core() -> Iterator[int]:
    """One process spinning `while True` per core while the test runs (a busy machine:
    llama.cpp's slots then compute slowly and its `/health` stalls); yields how many."""
    num_cores = os.cpu_count() or 1
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(num_cores)
    ]
    try:
        yield num_cores
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()


class _serving:
    """Start the server subprocess; wait for `/health`; stop it on exit."""

    def __init__(self, model: TinyModel, log: Path) -> None:
        self.model, self.log_path = model, log

    def __enter__(self) -> str:
        self.log = self.log_path.open("w")
        command = [
            sys.executable,
            str(SERVE_SCRIPT),
            str(self.model.gguf),
            str(N_CTX),
            str(N_PARALLEL),
        ]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        try:
            assert self.process.stdout is not None
            line = self.process.stdout.readline()  # blocks until listening, or exit
            if not line.startswith("listening "):
                raise RuntimeError(f"llama.cpp server did not start: {self._tail()}")
            url = line.split()[1].rstrip("/")
            self._wait_healthy(url)
            return url
        except BaseException:
            self.__exit__()
            raise

    def _wait_healthy(self, url: str) -> None:
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=10.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"llama.cpp server at {url} never became healthy: {self._tail()}")

    def _tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-2000:]

    def __exit__(self, *exc: object) -> None:
        stop_stdin_child(self.process)
        self.log.close()

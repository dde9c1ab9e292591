"""Start the engine on a free loopback port, and stop it cleanly: `running_engine`.

    with running_engine("vulnerable", context_length=1024) as engine:
        httpx.post(f"{engine.base_url}/v1/completions", json={...})
        engine.wait_drained()          # every side back to zero allocated pages

In one process (the default), uvicorn serves `build_app(config)` from a background thread
with its own event loop; the caller's thread and loop stay free. With `processes=True`,
prefill, decode and router are three `worker` subprocesses and KV pages cross a real TCP
socket (`TcpTransfer`); the children are stopped on exit, test failures included (and
they stop by themselves if this process dies: see `worker`).

`EngineHandle.state()` reads the router's `/kvcanary/state` debug endpoint: per side
`num_allocated_pages` and `num_running_requests`, plus `num_pending_prefill_exchanges`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from kvcanary.canaries.errors import ConfigError
from kvcanary.reference_engine.availability import require_engine

_STARTUP_TIMEOUT_S = 120.0
_STOP_GRACE_S = 10.0


def make_config(preset: str = "vulnerable", fixes: Iterable[str] = (), **overrides: Any) -> Any:
    """`EngineConfig.from_preset(preset, **overrides)` with `fixes` added to the preset's."""
    from kvcanary.reference_engine.config import FIXES, PRESETS, EngineConfig

    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    extra = frozenset(fixes)
    unknown = sorted(extra - set(FIXES))
    if unknown:
        raise ConfigError(f"unknown fix {', '.join(unknown)}; valid fixes: {', '.join(FIXES)}")
    try:
        config = EngineConfig.from_preset(preset, **overrides)
        if extra - config.fixes:
            config = EngineConfig.from_preset(
                preset, **{**overrides, "fixes": config.fixes | extra}
            )
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return config


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket (port 0: a free one)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=512)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class EngineHandle:
    """A running engine: where it listens, how it was configured, what it still holds."""

    base_url: str
    config: Any
    processes: bool = False
    urls: dict[str, str] = field(default_factory=dict)
    """Every server's URL (`router`, and `prefill` / `decode` in separate processes)."""
    bootstrap_port: int = 0
    """The prefill's KV bootstrap port in separate processes (0 in one process)."""
    attention: str = ""
    """The line saying which paged attention its sides run (`model.attention_path`)."""

    def state(self) -> dict[str, Any]:
        """The router's `/kvcanary/state`."""
        response = httpx.get(f"{self.base_url}/kvcanary/state", timeout=30)
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        return state

    def num_allocated_pages(self) -> dict[str, int]:
        """Allocated pages per side, e.g. `{"prefill": 0, "decode": 3}`."""
        return _pages(self.state())

    def wait_drained(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait until no side holds a page or runs a request; returns the final state."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if _drained(state):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine did not drain in {timeout_s:g} s: {state}")
            time.sleep(0.05)

    async def astate(self) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.get(f"{self.base_url}/kvcanary/state")
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        return state

    async def await_drained(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """`wait_drained` for async callers."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = await self.astate()
            if _drained(state):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine did not drain in {timeout_s:g} s: {state}")
            await asyncio.sleep(0.05)


def _pages(state: dict[str, Any]) -> dict[str, int]:
    return {
        role: sum(side["num_allocated_pages"] for side in state[role])
        for role in ("prefill", "decode")
    }


def _drained(state: dict[str, Any]) -> bool:
    sides = [*state["prefill"], *state["decode"]]
    return (
        not state["num_pending_prefill_exchanges"]
        and all(s["num_allocated_pages"] == 0 for s in sides)
        and all(s["num_running_requests"] == 0 for s in sides)
    )


class ThreadedServer:
    """uvicorn serving an app from a daemon thread with its own event loop."""

    def __init__(self, app: Any, sock: socket.socket) -> None:
        import uvicorn

        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self.url = url_of(sock)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="kvcanary-engine", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the engine failed to start (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the engine did not start in {_STARTUP_TIMEOUT_S:g} s")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the engine thread did not stop"


@dataclass
class _Child:
    role: str
    process: subprocess.Popen[bytes]
    url: str
    log: IO[bytes] | None


class ProcessCluster:
    """prefill, decode and router as `worker` subprocesses, on sockets bound here."""

    def __init__(
        self,
        config: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_dir: Path | None = None,
        inherit_output: bool = False,
    ) -> None:
        self.config = config
        self._router_sock = bind_socket(host, port)
        self.url = url_of(self._router_sock)
        self._inherit = inherit_output
        self._log_dir = log_dir
        self._own_log_dir: Path | None = None
        """A temporary log directory this cluster made: removed on a clean stop, kept (and
        named in the error) when a child failed."""
        self._failed = False
        self.children: list[_Child] = []
        self.bootstrap_port = 0
        """The prefill's KV bootstrap port (what `--prefill URL PORT` names to SGLang's router)."""

    def _spawn(self, role: str, sock: socket.socket, *args: str, fds: tuple[int, ...] = ()) -> None:
        from kvcanary.reference_engine.server.worker import config_to_json

        log: IO[bytes] | None = None
        if not self._inherit:
            log_dir = self._log_dir
            if log_dir is None:
                if self._own_log_dir is None:
                    self._own_log_dir = Path(tempfile.mkdtemp(prefix="kvcanary-engine-"))
                log_dir = self._own_log_dir
            log = (log_dir / f"{role}.log").open("wb")
        command = [
            sys.executable, "-m", "kvcanary.reference_engine.server.worker", role,
            "--config-json", config_to_json(self.config), "--http-fd", str(sock.fileno()), *args,
        ]  # fmt: skip
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            pass_fds=(sock.fileno(), *fds),
            start_new_session=True,  # Ctrl-C reaches the parent, which stops children in order
        )
        self.children.append(_Child(role, process, url_of(sock), log))

    def start(self) -> None:
        try:
            prefill_sock, decode_sock, bootstrap_sock = bind_socket(), bind_socket(), bind_socket()
            self.bootstrap_port = int(bootstrap_sock.getsockname()[1])
            bootstrap_port = str(self.bootstrap_port)
            fd = str(bootstrap_sock.fileno())
            self._spawn(
                "prefill", prefill_sock, "--bootstrap-fd", fd, fds=(bootstrap_sock.fileno(),)
            )
            self._spawn("decode", decode_sock, "--bootstrap-port", bootstrap_port)
            self._spawn(
                "router", self._router_sock, "--bootstrap-port", bootstrap_port,
                "--prefill-url", url_of(prefill_sock), "--decode-url", url_of(decode_sock),
            )  # fmt: skip
            for sock in (prefill_sock, decode_sock, bootstrap_sock, self._router_sock):
                sock.close()  # the children hold them now
            self._wait_healthy()
        except BaseException:
            self._failed = True
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        with httpx.Client(timeout=2.0) as client:
            for child in self.children:
                while True:
                    self.check_alive()
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(f"{child.url}/health").status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the {child.role} process did not become healthy")
                    time.sleep(0.05)

    def check_alive(self) -> None:
        """Raise if a child exited (with the tail of its log)."""
        for child in self.children:
            status = child.process.poll()
            if status is not None:
                self._failed = True
                raise RuntimeError(
                    f"the {child.role} process exited with status {status}{self._tail(child)}"
                )

    @staticmethod
    def _tail(child: _Child) -> str:
        if child.log is None:
            return ""
        child.log.flush()
        text = Path(child.log.name).read_bytes()[-2000:].decode(errors="replace").strip()
        return f"; its log ({child.log.name}) ends:\n{text}" if text else ""

    def stop(self) -> None:
        """Close each child's lifeline (router first), then kill whatever is left."""
        for child in reversed(self.children):
            if child.process.stdin is not None:
                with contextlib.suppress(OSError):
                    child.process.stdin.close()
        for child in reversed(self.children):
            try:
                child.process.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            if child.log is not None:
                child.log.close()
        with contextlib.suppress(OSError):
            self._router_sock.close()
        if self._own_log_dir is not None and not self._failed:
            shutil.rmtree(self._own_log_dir, ignore_errors=True)
            self._own_log_dir = None


@contextlib.contextmanager
def running_engine(
    preset: str = "vulnerable",
    *,
    fixes: Iterable[str] = (),
    processes: bool = False,
    **overrides: Any,
) -> Iterator[EngineHandle]:
    """The engine on a free loopback port for the duration of the block."""
    require_engine(
        "a run without --target", alternative="test a running deployment with --target URL"
    )
    config = make_config(preset, fixes, **overrides)
    from kvcanary.reference_engine.model.attention_path import choose_attention

    attention = choose_attention(config).line  # an impossible ask fails before any process
    if processes:
        cluster = ProcessCluster(config)
        cluster.start()
        try:
            urls = {"router": cluster.url} | {c.role: c.url for c in cluster.children}
            yield EngineHandle(
                cluster.url,
                config,
                processes=True,
                urls=urls,
                bootstrap_port=cluster.bootstrap_port,
                attention=attention,
            )
        finally:
            cluster.stop()
        return
    from kvcanary.reference_engine.server.app import build_app

    server = ThreadedServer(build_app(config), bind_socket())
    server.start()
    try:
        yield EngineHandle(server.url, config, urls={"router": server.url}, attention=attention)
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def running_engine_async(
    preset: str = "vulnerable",
    *,
    fixes: Iterable[str] = (),
    processes: bool = False,
    **overrides: Any,
) -> AsyncIterator[EngineHandle]:
    """`running_engine` for async callers: starting and stopping run off the event loop."""
    manager = running_engine(preset, fixes=fixes, processes=processes, **overrides)
    handle = await asyncio.to_thread(manager.__enter__)
    try:
        yield handle
    except BaseException as exc:
        suppress = await asyncio.to_thread(manager.__exit__, type(exc), exc, exc.__traceback__)
        if not suppress:
            raise
    else:
        await asyncio.to_thread(manager.__exit__, None, None, None)

"""`--ray`'s cluster: connected before the run writes anything or sends a request
(`ray_cluster`); an address that does not answer as Ray is refused in one line
(`check_address`), and nothing is left behind to stop the same `--out` from being used
again. Ray is imported here (`import_ray`), so a run without `--ray` never needs it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

from kvcanary.canaries.errors import ConfigError

LOCAL = "local"
"""`--ray` without an address: a Ray instance started here for the run (`ray.init()`)."""


@contextlib.contextmanager
def ray_cluster(address: str) -> Iterator[None]:
    """Connected to the Ray cluster at `address` (`local`: a Ray instance started here for
    the run) for the block; `ConfigError` when it cannot be reached. A Ray already
    initialised in this process is used as it is and left running; one started here is
    shut down at the end."""
    ray = import_ray()
    check_address(address)
    if ray.is_initialized():
        yield
        return
    try:
        ray.init(
            address=None if address == LOCAL else address,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"--ray {address}: cannot reach the Ray cluster: {exc}") from None
    try:
        yield
    finally:
        ray.shutdown()


CONNECT_TIMEOUT_S = 5.0
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""An HTTP/2 client's first bytes (the preface, then an empty SETTINGS frame): a Ray port
(gRPC) answers with a SETTINGS frame, a web server with an HTTP/1 error."""


def check_address(address: str) -> None:
    """Before anything starts: Ray is installed, and something answers at `address` that
    could be Ray. Ray itself retries an address for tens of seconds (an unreachable one for
    minutes); this refuses what is surely not Ray in seconds, in one line."""
    import_ray()
    where = address.removeprefix("ray://")
    host, sep, port = where.rpartition(":")
    if address in (LOCAL, "auto") or not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S) as sock:
            reply = b"" if os.environ.get("RAY_USE_TLS") else _first_reply(sock)
    except OSError as exc:
        raise ConfigError(
            f"--ray {address}: nothing answers at {host}:{port} ({exc.strerror or exc})"
        ) from None
    if reply.startswith(b"HTTP/"):
        raise ConfigError(
            f"--ray {address}: {host}:{port} answers as a web server (HTTP/1), not as Ray; "
            "give the cluster's GCS address (HOST:6379) or its Ray Client address "
            "(ray://HOST:10001)"
        )


def _first_reply(sock: socket.socket) -> bytes:
    """What `sock` answers an HTTP/2 preface with (empty when it says nothing in time)."""
    try:
        sock.sendall(_H2_PREFACE)
        sock.settimeout(CONNECT_TIMEOUT_S)
        return sock.recv(16)
    except OSError:
        return b""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--ray needs Ray: pip install 'kvcanary[ray]' (or pip install ray)"
        ) from None
    return ray

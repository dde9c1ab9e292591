"""A loopback TCP listener that speaks no HTTP of its own: each accepted connection is handed
to a function (reset it, answer plain HTTP to a TLS client, ...), then closed."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def raw_listener(handle: Callable[[socket.socket], None]) -> Iterator[int]:
    """Listen on a free 127.0.0.1 port until the block ends; yields the port."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):
                handle(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()

"""One process of the separate-process engine: `python -m reference_engine.server.worker ROLE`.

The parent (`launch.ProcessCluster`) binds every listening socket itself and passes them
by file descriptor, so ports are known before a child starts and no port can be taken in
between. A prefill worker serves its side app and listens for KV bootstrap connections
(`TcpTransfer.listen`); a decode worker's `TcpTransfer` connects to the bootstrap address
each request names; the router worker reaches both over HTTP. The config arrives as JSON
(`config_to_json`).

Each worker watches its stdin: the parent holds the other end, so when the parent exits,
however it exits, the worker sees EOF and shuts down. SIGINT and SIGTERM shut it down too,
quietly, with exit status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

ROLES = ("prefill", "decode", "router")


def config_to_json(config: Any) -> str:
    """An EngineConfig as JSON (fixes as a sorted list)."""
    fields = dataclasses.asdict(config)
    fields["fixes"] = sorted(fields["fixes"])
    return json.dumps(fields)


def config_from_json(text: str) -> Any:
    from kvcanary.reference_engine.config import EngineConfig

    return EngineConfig(**json.loads(text))


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvcanary.reference_engine.server.worker")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--http-fd", type=int, required=True)
    parser.add_argument("--bootstrap-fd", type=int, help="prefill: the KV bootstrap socket")
    parser.add_argument("--bootstrap-host", default="127.0.0.1")
    parser.add_argument("--bootstrap-port", type=int, default=0)
    parser.add_argument("--prefill-url", help="router: the prefill server")
    parser.add_argument("--decode-url", help="router: the decode server")
    return parser.parse_args(argv)


def _build_app(args: argparse.Namespace, config: Any) -> tuple[Any, Any]:
    """The worker's app and, for prefill and decode, its TcpTransfer."""
    from kvcanary.reference_engine.server.app import build_side_app
    from kvcanary.reference_engine.server.router import (
        MiniLoadBalancer,
        SideEndpoint,
        build_router_app,
        side_client,
    )
    from kvcanary.reference_engine.server.tcp_transfer import TcpTransfer

    if args.role == "router":
        prefill = SideEndpoint(
            args.prefill_url,
            side_client(args.prefill_url),
            bootstrap_host=args.bootstrap_host,
            bootstrap_port=args.bootstrap_port,
        )
        decode = SideEndpoint(args.decode_url, side_client(args.decode_url))
        balancer = MiniLoadBalancer(
            [prefill], [decode], merge_prefill_usage=config.merge_prefill_usage
        )
        return build_router_app(balancer), None

    import torch

    from kvcanary.reference_engine.engine import build_decode, build_prefill

    # two compute processes share the machine: intra-op threads beyond their half only contend
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    if args.role == "prefill":
        transfer = TcpTransfer(bandwidth_bytes_per_s=config.transfer_bandwidth_bytes_per_s)
        return build_side_app(build_prefill(config, transfer), "prefill", config), transfer
    transfer = TcpTransfer(default_bootstrap=(args.bootstrap_host, args.bootstrap_port))

    def route(req: Any) -> None:
        transfer.route_room(req.bootstrap_room, req.bootstrap_host, req.bootstrap_port)

    decode_app = build_side_app(build_decode(config, transfer), "decode", config, on_request=route)
    return decode_app, transfer


def _watch_stdin(loop: asyncio.AbstractEventLoop, server: Any) -> None:
    def wait_for_eof() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    threading.Thread(target=wait_for_eof, name="parent-lifeline", daemon=True).start()


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    config = config_from_json(args.config_json)
    app, transfer = _build_app(args, config)
    http_sock = socket.socket(fileno=args.http_fd)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    )
    _watch_stdin(asyncio.get_running_loop(), server)
    try:
        if args.role == "prefill":
            await transfer.listen(sock=socket.socket(fileno=args.bootstrap_fd))
        await server.serve(sockets=[http_sock])
    finally:
        if transfer is not None:
            await transfer.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

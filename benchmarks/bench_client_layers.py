"""Where one unpaced stream's CPU goes: the client's layers, one at a time, against raw aiohttp.

`bench_client.py` measures whole clients. At one stream against a server that answers at
once, the client's own CPU per request sets the rate, and there the harness trails raw
aiohttp. This measures the harness's path cut at each layer, on the same server, in
interleaved rounds, as CPU µs per request (`process_time`, medians over rounds):

    aiohttp-bytes     the baseline's aiohttp session, body read with `iter_any`, nothing
                      parsed: the I/O floor
    aiohttp           bench_client's `aiohttp` client: line reads, json.loads, stamp (1.00x)
    transport         `HttpClient.direct.handle_async_request` on one prebuilt request, body
                      read chunk by chunk: the httpx-aiohttp layer over aiohttp
    transport+build   the same with `TargetClient.build_request` for every request
    send              bench_client's `harness` client (`TargetClient.send`): the above plus
                      metering, SSE decoding, parsing every field the detectors read,
                      stamping and the observation

    .venv/bin/python benchmarks/bench_client_layers.py            # 5 rounds of 1,500 requests
    .venv/bin/python benchmarks/bench_client_layers.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import bench_client
import httpx

from kvcanary.harness.target.http_client import HttpClient

Layer = Callable[[], Awaitable[None]]
LAYERS = ["aiohttp-bytes", "aiohttp", "transport", "transport+build", "send"]
BASELINE = "aiohttp"


async def measure(
    url: str, *, num_chunks: int, num_requests: int, rounds: int
) -> dict[str, list[float]]:
    """CPU µs per request of each layer, one list entry per round."""
    harness = bench_client.HarnessClient(url, 1)
    if not isinstance(harness.http, HttpClient) or harness.http.direct is None:
        raise SystemExit("a proxy is set in the environment: requests do not go direct")
    direct = harness.http.direct
    baseline = bench_client.AiohttpClient(url, 1)
    plan = bench_client.plan_for(num_chunks, 0)
    prebuilt = harness.target.build_request(plan, bench_client.TENANT)
    body = bench_client.body_for(num_chunks)

    async def aiohttp_bytes() -> None:
        async with baseline.session.post(baseline.url, json=body) as response:
            async for _ in response.content.iter_any():
                pass

    async def aiohttp_lines() -> None:
        await baseline.one(0, num_chunks)

    async def transport(request: httpx.Request | None = None) -> None:
        response = await direct.handle_async_request(request or prebuilt)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        async for _ in response.stream:
            pass
        await response.aclose()

    async def transport_build() -> None:
        await transport(harness.target.build_request(plan, bench_client.TENANT))

    async def send() -> None:
        sample = await harness.one(0, num_chunks)
        assert sample.num_events == num_chunks, sample.num_events

    layers: dict[str, Layer] = {
        "aiohttp-bytes": aiohttp_bytes,
        "aiohttp": aiohttp_lines,
        "transport": transport,
        "transport+build": transport_build,
        "send": send,
    }
    cpu: dict[str, list[float]] = {name: [] for name in LAYERS}
    try:
        for _ in range(rounds):
            for name in LAYERS:
                layer = layers[name]
                for _ in range(20):  # connection open, caches warm
                    await layer()
                gc.collect()
                cpu0 = time.process_time()
                for _ in range(num_requests):
                    await layer()
                cpu[name].append((time.process_time() - cpu0) / num_requests * 1e6)
                print(f"{name:>16} {cpu[name][-1]:6.0f} µs CPU/request", file=sys.stderr)
    finally:
        await baseline.close()
        await harness.close()
    return cpu


def markdown(cpu: dict[str, list[float]], args: argparse.Namespace) -> str:
    base = statistics.median(cpu[BASELINE])
    lines = [
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, httpx {httpx.__version__}, "
        f"aiohttp {aiohttp.__version__}; 1 stream, unpaced, {args.chunks} chunks per stream, "
        f"{args.rounds} rounds of {args.requests:,} requests per layer",
        "",
        "| layer | CPU µs/request (median) | min | max | vs aiohttp |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in LAYERS:
        values = cpu[name]
        median = statistics.median(values)
        lines.append(
            f"| {name} | {median:,.0f} | {min(values):,.0f} | {max(values):,.0f} "
            f"| {median / base:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1500, help="per layer and round")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/bench_client_layers.json"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.chunks = 1, 50, 8
    port = bench_client.free_port()
    server = bench_client.start_server(port)
    try:
        url = f"http://127.0.0.1:{port}"
        cpu = asyncio.run(
            measure(url, num_chunks=args.chunks, num_requests=args.requests, rounds=args.rounds)
        )
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(markdown(cpu, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(cpu, indent=2))


if __name__ == "__main__":
    main()

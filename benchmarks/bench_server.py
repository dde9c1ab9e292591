"""Requests/s and TTFT of the reference engine: one process vs separate processes.

    .venv/bin/python benchmarks/bench_server.py [--requests 48] [--concurrency 4]

Both modes serve the same small streamed completions (distinct prompts of `--prompt-words`
words, `--max-tokens` tokens each) from the vulnerable preset, after a short warm-up. The
separate-process mode adds two HTTP hops per request (router -> prefill, router -> decode)
and moves every KV page over the TCP transfer instead of an in-memory copy; the ratio says
what that costs. Figures go in benchmarks/RESULTS-server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from kvcanary.reference_engine.server.launch import running_engine


async def _one(client: httpx.AsyncClient, index: int, args: argparse.Namespace) -> float:
    words = " ".join(f"w{index}x{i}" for i in range(args.prompt_words))
    body = {"prompt": words, "max_tokens": args.max_tokens, "stream": True}
    started = time.perf_counter()
    ttft: float | None = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.status_code
        async for line in response.aiter_lines():
            first_token = ttft is None and line.startswith("data: {")
            if first_token and json.loads(line[6:])["choices"]:
                ttft = time.perf_counter() - started
    assert ttft is not None, "no token streamed"
    return ttft


async def _load(base_url: str, args: argparse.Namespace, num_requests: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(num_requests):
            queue.put_nowait(i)
        ttfts: list[float] = []

        async def worker() -> None:
            while not queue.empty():
                ttfts.append(await _one(client, queue.get_nowait(), args))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
    return {
        "requests_per_s": num_requests / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p90_ms": 1000 * statistics.quantiles(ttfts, n=10)[-1],
    }


def measure(processes: bool, args: argparse.Namespace) -> dict[str, float]:
    overrides: dict[str, Any] = {"context_length": args.context_length}
    with running_engine("vulnerable", processes=processes, **overrides) as engine:
        asyncio.run(_load(engine.base_url, args, args.warmup))
        result = asyncio.run(_load(engine.base_url, args, args.requests))
        engine.wait_drained()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--context-length", type=int, default=1024)
    args = parser.parse_args()
    one = measure(False, args)
    many = measure(True, args)
    print(f"{'mode':<20} {'req/s':>8} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12}")
    for name, result in (("one process", one), ("separate processes", many)):
        print(
            f"{name:<20} {result['requests_per_s']:>8.1f} {result['ttft_p50_ms']:>12.1f} "
            f"{result['ttft_p90_ms']:>12.1f}"
        )
    print(
        f"ratio (processes / one process): req/s "
        f"{many['requests_per_s'] / one['requests_per_s']:.2f}, TTFT p50 "
        f"{many['ttft_p50_ms'] / one['ttft_p50_ms']:.2f}"
    )


if __name__ == "__main__":
    main()

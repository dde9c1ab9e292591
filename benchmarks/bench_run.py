"""End to end: `kvcanary run` against a bare aiohttp loop, AIPerf and GuideLLM, same server.

Every tool drives the same OpenAI-compatible SSE server that answers at once
(`benchmarks/instant_server.py`, its own process) with N streamed completions at a
concurrency of C, in interleaved rounds (the order rotates each round), so what is measured
is each client's own cost. Reported per tool (median of the rounds): requests/s over the run
window (first request sent to last one done, from each tool's own per-request stamps), the
mean number of requests in flight over that window (the sum of request durations divided
by it), and for the in-process clients the CPU per request in the window; ratios are
against kvcanary in the same run.

    kvcanary   `kvcanary run --profile below --pool-tokens L --context-tokens L --tokenizer
               cl100k_base` in a child process (the CLI, all detectors and the journal on);
               CPU is `Runner.run`'s process time (all threads) per request
    bare       a closed loop of C aiohttp workers on one session: post, read SSE lines,
               `json.loads` each (the floor any Python client sits on)
    aiperf     AIPerf 0.13 (`aiperf profile --endpoint-type completions --streaming`)
    guidellm   GuideLLM 0.8.1 (`guidellm run --profile kind=concurrent`)

The peers run from their own virtual environments, made by this script under `--venvs`
(pip, from PyPI; `--find-links DIR` adds a folder of wheels). `--baseline-tree DIR` adds
`kvcanary@baseline`, the same run from another source tree (before and after in one run).
All tools count tokens with the same tokenizer: tiktoken's cl100k_base, which kvcanary uses
directly and the peers load as a Hugging Face tokenizer folder this script writes from
tiktoken's ranks (checked to give the same token ids). AIPerf cannot load a local tokenizer
path under `HF_HUB_OFFLINE=1` (it looks the path up as a Hub repo id: `HFValidationError`),
so the folder is also laid out
as a cached Hub repo (`<HF_HOME>/hub/models--kvcanary--cl100k_base/snapshots/<rev>`) in a
private HF_HOME and AIPerf gets `--tokenizer kvcanary/cl100k_base`: offline, nothing is
fetched. Peers send the prompt length and answer length kvcanary's plans average (measured
from a first kvcanary run's journal).

    .venv/bin/python benchmarks/bench_run.py                       # 3 rounds, all peers
    .venv/bin/python benchmarks/bench_run.py --peers none --rounds 1 --requests 300  # quick
    .venv/bin/python benchmarks/bench_run.py --profile-cpu          # + py-spy cost centres
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import instant_server
import run_peers

HERE = Path(__file__).resolve().parent
LIMIT = 500
"""Pool and context of the `below` profile's sizes: prompts of 62-499 tokens, ~290 mean."""


# -- children: one measured run each, a JSON line on stdout ----------------------------


def kvcanary_child(url: str, out: str, num_requests: int, concurrency: int) -> dict[str, Any]:
    """One `kvcanary run` in this process, its runner timed."""
    import contextlib
    import io

    from kvcanary.harness.cli import main as cli
    from kvcanary.harness.run import runner as runner_module

    window: dict[str, float] = {}
    run = runner_module.Runner.run

    async def timed(self: runner_module.Runner) -> runner_module.RunOutcome:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return await run(self)
        finally:
            window["wall_s"] = time.perf_counter() - wall
            window["cpu_s"] = time.process_time() - cpu

    runner_module.Runner.run = timed  # type: ignore[method-assign]
    argv = [
        *("run", "--target", url, "--requests", str(num_requests)),
        *("--concurrency", str(concurrency), "--tokenizer", "cl100k_base", "--seed", "7"),
        *("--pool-tokens", str(LIMIT), "--context-tokens", str(LIMIT), "--profile", "below"),
        *("--out", out),
    ]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        status = cli(argv)
    spans, chunks, prompt_tokens = [], [], []
    num_bytes = sum(p.stat().st_size for p in Path(out).glob("journal*"))
    for line in (Path(out) / "journal.jsonl").open("rb"):
        if line.startswith(b'{"type":"observation"'):
            record = json.loads(line)
            spans.append((record["t_sent_ns"] / 1e9, record["t_done_ns"] / 1e9))
            chunks.append(record["num_chunks"])
        elif line.startswith(b'{"type":"plan"'):
            prompt_tokens.append(json.loads(line)["num_prompt_tokens"])
    return {
        **run_peers.window_stats(spans),
        "status": status,
        "cpu_us": window["cpu_s"] / len(spans) * 1e6,
        "journal_bytes_per_request": num_bytes / len(spans),
        "mean_chunks": statistics.mean(chunks),
        "mean_prompt_tokens": statistics.mean(prompt_tokens),
    }


def bare_child(
    url: str, num_requests: int, concurrency: int, shape: tuple[int, int]
) -> dict[str, Any]:
    """A closed loop of plain aiohttp workers: post, read SSE lines, json.loads each."""
    import aiohttp

    prompt_tokens, answer_tokens = shape
    prompt = run_peers.cl100k_text(prompt_tokens)

    async def main() -> tuple[list[tuple[float, float]], float]:
        spans: list[tuple[float, float]] = []
        left = [num_requests]
        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker() -> None:
                while left[0] > 0:
                    left[0] -= 1
                    body = {"model": "instant", "prompt": prompt, "stream": True}
                    body["max_tokens"] = answer_tokens
                    start = time.perf_counter()
                    async with session.post(f"{url}/v1/completions", json=body) as response:
                        async for line in response.content:
                            if line.startswith(b"data: {"):
                                json.loads(line[6:])
                    spans.append((start, time.perf_counter()))

            cpu = time.process_time()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return spans, time.process_time() - cpu

    spans, cpu_s = asyncio.run(main())
    return {**run_peers.window_stats(spans), "cpu_us": cpu_s / len(spans) * 1e6}


# -- the parent: rounds, peers, table ---------------------------------------------------


def child(args: list[str], tree: str | None = None) -> dict[str, Any]:
    """Runs this script's child `args[0]`; `tree`: import kvcanary from that source tree."""
    env = None if tree is None else {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(
        [sys.executable, str(Path(__file__)), *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_kvcanary(
    url: str, work: Path, args: argparse.Namespace, tree: str | None = None
) -> dict[str, Any]:
    out = work / f"kvcanary-{time.monotonic_ns()}"
    try:
        command = ["kvcanary-child", url, str(out), str(args.requests), str(args.concurrency)]
        return child(command, tree)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def bench(args: argparse.Namespace, url: str, work: Path) -> dict[str, list[dict[str, Any]]]:
    first = run_kvcanary(url, work, args)  # a warm-up, and the shape the peers copy
    shape = (round(first["mean_prompt_tokens"]), round(first["mean_chunks"]))
    print(f"shape from kvcanary's plans: {shape[0]} prompt tokens, {shape[1]} chunks", flush=True)
    tools: dict[str, Callable[[], dict[str, Any]]] = {
        "kvcanary": lambda: run_kvcanary(url, work, args),
        "bare": lambda: child(
            ["bare-child", url, str(args.requests), str(args.concurrency), *map(str, shape)]
        ),
    }
    if args.baseline_tree:
        tools["kvcanary@baseline"] = lambda: run_kvcanary(url, work, args, args.baseline_tree)
    peers = run_peers.Peers(Path(args.venvs), args.find_links, work)
    for name in args.peers:
        peers.install(name)
        tools[name] = lambda name=name: peers.run(name, url, args.requests, args.concurrency, shape)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in tools}
    order = list(tools)
    for number in range(args.rounds):
        for name in order[number % len(order) :] + order[: number % len(order)]:
            result = tools[name]()
            results[name].append(result)
            print(f"round {number + 1} {name}: {json.dumps(result)}", flush=True)
    return results


def markdown(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, loads: str) -> str:
    def median(name: str, key: str) -> float | None:
        values = [r[key] for r in results[name] if r.get(key) is not None]
        return statistics.median(values) if values else None

    base = median("kvcanary", "req_s") or 1.0
    lines = [
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, {args.requests} requests at "
        f"concurrency {args.concurrency}, {args.rounds} round(s), load average {loads}",
        "",
        "| tool | req/s (median) | ratio to kvcanary | in flight (mean) | CPU/request |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in results:
        rate, flight, cpu = (median(name, k) for k in ("req_s", "in_flight", "cpu_us"))
        cpu_text = f"{cpu:,.0f} µs" if cpu is not None else "n/a"
        lines.append(
            f"| {name} | {rate or 0:,.0f} | {(rate or 0) / base:.2f}x | {flight or 0:.1f} | "
            f"{cpu_text} |"
        )
    journal = median("kvcanary", "journal_bytes_per_request")
    lines.append(f"\nkvcanary journal: {journal or 0:,.0f} bytes per request")
    return "\n".join(lines)


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].endswith("-child"):
        kind, rest = sys.argv[1], sys.argv[2:]
        if kind == "kvcanary-child":
            print(json.dumps(kvcanary_child(rest[0], rest[1], int(rest[2]), int(rest[3]))))
        else:
            shape = (int(rest[3]), int(rest[4]))
            print(json.dumps(bare_child(rest[0], int(rest[1]), int(rest[2]), shape)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", default="aiperf,guidellm", help="comma list, or none")
    parser.add_argument("--venvs", default=str(run_peers.default_venvs()))
    parser.add_argument("--find-links", default=None, help="a folder of wheels for pip")
    parser.add_argument("--profile-cpu", action="store_true", help="py-spy kvcanary's run")
    parser.add_argument(
        "--baseline-tree",
        default=None,
        help="also run kvcanary from this source tree (e.g. `git archive HEAD` unpacked, with "
        "the compiled extensions copied in): before/after in the same run",
    )
    args = parser.parse_args()
    args.peers = [] if args.peers == "none" else args.peers.split(",")
    port = instant_server.free_port()
    server = instant_server.start(port)
    url = f"http://127.0.0.1:{port}"
    before = load_average()
    try:
        with tempfile.TemporaryDirectory(prefix="kvcanary-bench-run-") as tmp:
            results = bench(args, url, Path(tmp))
            print(markdown(results, args, f"{before} -> {load_average()}"))
            if args.profile_cpu:
                print(run_peers.profile_kvcanary(Path(__file__), url, Path(tmp), args))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()

"""What a 1,048,576-token prompt costs the harness: to build, and to send.

(a) Build: `canaries.build_prompt` (cl100k_base, page size 16 and 64) against one tiktoken
    encode of the same text, interleaved, best of 7 (the goal: at most 1.2x at page 16).
    The same build with the numpy SipHash in place of the compiled one
    (`canaries._siphash`) is timed alongside. `--compare-with PATH` times another version
    of `canaries/prompt.py` alongside (for example `git show HEAD:canaries/prompt.py >
    /tmp/old_prompt.py`), in the same run. `--build-only` skips (b).
(b) Send: the client's Python heap peak (tracemalloc) while `TargetClient.send` posts a
    1M-token prompt to a local server (the `bench_client` server, one answer chunk), for
    each HTTP backend, against the baseline of the same body posted with httpx's `json=`
    (which encodes the whole body into one bytes object first). The prompt itself exists
    before the measurement starts: the figures are what sending adds.

    .venv/bin/python benchmarks/bench_prompt.py
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import bench_client
import httpx

from kvcanary.canaries import CanaryMinter, build_prompt, load_tokenizer, siphash
from kvcanary.harness.target.client import TargetClient, make_http_client
from kvcanary.harness.target.http_client import BACKENDS
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant

NUM_TOKENS = 1_048_576
TENANT = Tenant(name="bench")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("prompt_compared", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def numpy_siphash(build: Callable[..., object], **kwargs: Any) -> object:
    """`build(**kwargs)` with the numpy SipHash rounds in place of the compiled core."""
    core, siphash.CORE = siphash.CORE, None
    try:
        return build(**kwargs)
    finally:
        siphash.CORE = core


def bench_build(compare_with: Path | None, repeat: int) -> list[str]:
    tokenizer = load_tokenizer("cl100k_base")
    minter = CanaryMinter.from_seed(1, "bench")
    other = load_module(compare_with) if compare_with else None
    rows = [
        "| page size | canaries | text | build | encode | build / encode "
        "| build with numpy SipHash / encode |" + (" compared / encode |" if other else ""),
        "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if other else ""),
    ]
    for page_size in (16, 64):
        kwargs: dict[str, Any] = {"num_tokens": NUM_TOKENS, "page_size": page_size}
        prompt = build_prompt(tokenizer, minter, tenant=1, request=1, **kwargs)
        if other is not None:  # warm its caches too
            same = other.build_prompt(tokenizer, minter, tenant=1, request=1, **kwargs)
            assert (same.text, same.canaries) == (prompt.text, prompt.canaries)
        builds, encodes, others, numpys = [], [], [], []
        build = functools.partial(build_prompt, tokenizer, minter, tenant=1, **kwargs)
        encode = functools.partial(tokenizer.encode, prompt.text)
        for i in range(repeat):  # interleaved: load from other processes hits all alike
            builds.append(timed(functools.partial(build, request=i)))
            encodes.append(timed(encode))
            numpys.append(timed(functools.partial(numpy_siphash, build, request=i)))
            if other is not None:
                compared = functools.partial(other.build_prompt, tokenizer, minter, tenant=1)
                others.append(timed(functools.partial(compared, request=i, **kwargs)))
        best_build, best_encode = min(builds), min(encodes)
        row = (
            f"| {page_size} | {len(prompt.canaries):,} | {len(prompt.text) / 1e6:.2f} MB "
            f"| {best_build * 1e3:.0f} ms | {best_encode * 1e3:.0f} ms "
            f"| **{best_build / best_encode:.2f}x** | {min(numpys) / best_encode:.2f}x |"
        )
        if other is not None:
            row += f" {min(others) / best_encode:.2f}x |"
        rows.append(row)
    return rows


def plan_of(prompt: str) -> RequestPlan:
    return RequestPlan(
        request_id="b-r000001",
        tenant=TENANT.name,
        phase="bench",
        intent="victim",
        size_label="1M",
        num_prompt_tokens=NUM_TOKENS,
        expected="accept",
        api="completions",
        prompt=prompt,
        max_tokens=1,
    )


async def heap_peak(send: Callable[[], Any]) -> int:
    """The heap's peak above its level when `send` starts (the second of two sends: the
    first opens the connection and warms every cache)."""
    await send()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    await send()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak - base


async def send_plan(target: TargetClient, plan: RequestPlan) -> None:
    observation = await target.send(plan, TENANT, t_scheduled_ns=0)
    assert observation.ok, observation.error


async def post_json(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
    response = await http.post(url, json=body)
    await response.aread()
    assert response.status_code == 200


async def bench_send(url: str, prompt: str) -> list[str]:
    plan = plan_of(prompt)
    rows = [
        "| backend | sent with | heap peak while sending | vs the prompt's bytes |",
        "|---|---|---:|---:|",
    ]
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "stream": True}
    for backend in BACKENDS:
        async with make_http_client(max_concurrency=1, backend=backend) as http:
            target = TargetClient(http, url, model="m")
            streamed = functools.partial(send_plan, target, plan)
            whole = functools.partial(post_json, http, f"{url}/v1/completions", body)
            for name, send in (("TargetClient (streamed body)", streamed), ("httpx json=", whole)):
                peak = await heap_peak(send)
                rows.append(
                    f"| {backend} | {name} | {peak / 2**20:.1f} MiB | {peak / len(prompt):.2f}x |"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare-with", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--build-only", action="store_true", help="skip (b), the send")
    args = parser.parse_args()
    core = "compiled" if siphash.CORE else "numpy (canaries._siphash not built)"
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPUs, load average {load:.1f} at start, SipHash: {core}\n")
    print("\n".join(bench_build(args.compare_with, args.repeat)))
    if args.build_only:
        return
    tokenizer = load_tokenizer("cl100k_base")
    minter = CanaryMinter.from_seed(1, "bench")
    prompt = build_prompt(tokenizer, minter, tenant=1, request=1, num_tokens=NUM_TOKENS).text
    port = bench_client.free_port()
    server = bench_client.start_server(port)
    try:
        rows = asyncio.run(bench_send(f"http://127.0.0.1:{port}", prompt))
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"\nprompt: {len(prompt) / 2**20:.1f} MiB of text\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

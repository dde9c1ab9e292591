"""Benchmark of the canaries package: prompt building and stream scanning.

Run: `python benchmarks/bench_canaries.py` (about half a minute). Figures are ratios
against baselines measured in the same run, on the same text:

(a) building a 1,048,576-token canary-laced prompt (cl100k_base, page size 16 and 64)
    versus one tiktoken encode of the same text; the goal is at most 2x;
(b) scanning with 100,000 live canaries, in MB/s (millions of characters per second),
    versus a plain `str.find` loop for one canary and versus `re` with an alternation of
    1,000 of the canaries. The text is a benign mix (prose, some with typographic quotes,
    code, hex, UUIDs) with a live canary echoed every ~20 KB; the worst case is a text made
    only of canary words;
(c) the µs per hit of scanning a response that echoes a whole laced 1M-token prompt
    (104,857 hits of its own canaries; the goal is at most 1 µs with all layers), versus the
    pure-Python steps and the reference path.

Times are the best of several repetitions (the machine may be shared), and for the echo's
µs per hit also the median of several (all layers interleaved with the exact layer alone,
the slower baselines after them). `--scan-only` skips
(a); `--echo-only` runs only the echo rows (µs per hit), with `--repeat` rounds (default 9).
Prints Markdown.
"""

from __future__ import annotations

import os
import platform
import random
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tiktoken

from kvcanary.canaries import (
    WORDS,
    CanaryIndex,
    CanaryMinter,
    Owner,
    build_prompt,
    load_tokenizer,
    scanner_fast,
)
from kvcanary.canaries.prose import Prose

NUM_TOKENS = 1_048_576
NUM_LIVE = 100_000


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def interleaved(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, list[float]]:
    """Each function's times over `repeat` rounds, one call of each per round (load from
    other processes then hits them all alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    model = platform.processor() or "unknown CPU"
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return (
        f"{model}, {os.cpu_count()} CPUs visible, Python {platform.python_version()}, "
        f"numpy {np.__version__}, tiktoken {tiktoken.__version__}, {platform.system()}, "
        f"load average {os.getloadavg()[0]:.1f} at start, scanner core: "
        f"{'compiled (canaries._foldscan)' if scanner_fast.CORE else 'pure Python (not built)'}"
    )


def bench_build() -> list[str]:
    tokenizer = load_tokenizer("cl100k_base")
    minter = CanaryMinter.from_seed(1, "bench")
    rows = []
    for page_size in (16, 64):
        build_prompt(tokenizer, minter, tenant=0, request=0, num_tokens=4096, page_size=page_size)
        prompt = build_prompt(
            tokenizer, minter, tenant=1, request=1, num_tokens=NUM_TOKENS, page_size=page_size
        )

        def build_one(page_size: int = page_size) -> object:
            return build_prompt(
                tokenizer, minter, tenant=1, request=2, num_tokens=NUM_TOKENS, page_size=page_size
            )

        def encode_one(text: str = prompt.text) -> object:
            return tokenizer.encode(text)

        builds, encodes = [], []
        for _ in range(7):  # interleaved, so that load from other processes hits both alike
            builds.append(best_of(build_one, 1))
            encodes.append(best_of(encode_one, 1))
        build, encode = min(builds), min(encodes)
        rows.append(
            f"| {page_size} | {len(prompt.canaries):,} | {len(prompt.text) / 1e6:.2f} MB | "
            f"{build * 1e3:.0f} ms | {encode * 1e3:.0f} ms | **{build / encode:.2f}x** |"
        )
    return rows


def benign_text(minter: CanaryMinter, live: list[str], size: int) -> str:
    rng = random.Random(3)
    prose = Prose(load_tokenizer("cl100k_base"), seed=3)
    paragraph = " ".join(prose.snippets(51)) + "\n\n"
    parts: list[str] = []
    total = 0
    while total < size:
        kind = rng.random()
        if kind < 0.45:
            part = paragraph + rng.choice(prose.snippets(40)) + ".\n"
        elif kind < 0.6:  # typographic quotes and dashes: the non-ASCII path
            part = "\u201c" + rng.choice(prose.snippets(40)) + "\u201d \u2014 it\u2019s so.\n"
        elif kind < 0.75:
            part = "def f(x):\n    return {'k': x + 1, 'v': [i * 2 for i in range(x)]}\n" * 3
        elif kind < 0.9:
            part = " ".join(rng.randbytes(16).hex() for _ in range(8)) + "\n"
        else:
            part = " ".join(str(uuid.UUID(int=rng.getrandbits(128))) for _ in range(6)) + "\n"
        parts.append(part)
        total += len(part)
        if total // 20_000 != (total - len(part)) // 20_000:
            parts.append(f" As quoted: {rng.choice(live)}. ")
    return "".join(parts)[:size]


def bench_scan() -> list[str]:
    minter = CanaryMinter.from_seed(2, "bench")
    index = CanaryIndex(minter)
    live = []
    for request in range(NUM_LIVE // 5000):
        batch = minter.mint_many(0, request, range(5000))
        index.add_many((canary, Owner("t", f"r{request}")) for canary in batch)
        live += batch
    text = benign_text(minter, live, 64 * 1024 * 1024)
    words_only = " ".join(random.Random(4).choice(WORDS) for _ in range(1_500_000))
    mb = len(text) / 1e6

    def scan(
        body: str,
        chunk: int,
        reference: bool = False,
        on: CanaryIndex = index,
        exact_only: bool = False,
    ) -> int:
        scanner = on.scanner(reference=reference, exact_only=exact_only)
        hits = 0
        for start in range(0, len(body), chunk):
            hits += len(scanner.feed(body[start : start + chunk]))
        return hits + len(scanner.finish())

    def python_steps(fn: Callable[[], object]) -> Callable[[], object]:
        """`fn` with the fast path's pure-Python steps in place of the compiled core."""

        def run() -> object:
            core, scanner_fast.CORE = scanner_fast.CORE, None
            try:
                return fn()
            finally:
                scanner_fast.CORE = core

        return run

    # the exact and normalized (tag) layers alone: the same canaries, no fragment layer
    tags_only = CanaryIndex(minter)
    tags_only.add_many((canary, Owner("t", "r")) for canary in live)
    tags_only._fragments.clear()

    num_hits = scan(text, 1 << 20)
    assert num_hits == scan(text, 1 << 20, reference=True)
    assert num_hits == python_steps(lambda: scan(text, 1 << 20))()
    assert num_hits == scan(text, 1 << 20, on=tags_only)  # the echoes are verbatim canaries
    assert num_hits == scan(text, 1 << 20, exact_only=True)
    events = text[: 1 << 21]  # an SSE stream: one ~4-character token per event
    events_mb = len(events) / 1e6
    per_event = len(events) / 4 / 1e6  # millions of events, for µs per event
    one = live[12345]

    def find_loop(body: str = text) -> int:
        count, position = 0, body.find(one)
        while position >= 0:
            count, position = count + 1, body.find(one, position + 1)
        return count

    chosen = random.Random(5).sample(live, 1000)
    alternation = re.compile("|".join(map(re.escape, chosen)))
    tagless = re.compile("|".join(re.escape(canary.split(" ", 1)[1]) for canary in chosen))
    sample = text[: 8 * 1024 * 1024]
    sse, sse_ref = best_of(lambda: scan(events, 4), 3), best_of(lambda: scan(events, 4, True), 1)
    rows = [
        ("kvcanary scanner, 1 MiB chunks", mb / best_of(lambda: scan(text, 1 << 20), 3)),
        (
            "fast path's pure-Python steps (no compiled core), 1 MiB chunks",
            mb / best_of(python_steps(lambda: scan(text, 1 << 20)), 3),
        ),
        (
            "reference path (before), 1 MiB chunks",
            mb / best_of(lambda: scan(text, 1 << 20, True), 1),
        ),
        (
            "kvcanary scanner, exact and normalized layers alone (no fragment layer), 1 MiB chunks",
            mb / best_of(lambda: scan(text, 1 << 20, on=tags_only), 3),
        ),
        (
            "kvcanary scanner, exact layer alone (`exact_only=True`, raw text), 1 MiB chunks",
            mb / best_of(lambda: scan(text, 1 << 20, exact_only=True), 3),
        ),
        ("kvcanary scanner, 4 KiB chunks", mb / best_of(lambda: scan(text, 4096), 3)),
        ("kvcanary scanner, 64-char chunks", mb / best_of(lambda: scan(text, 64), 1)),
        ("reference path (before), 64-char chunks", mb / best_of(lambda: scan(text, 64, True), 1)),
        (f"kvcanary scanner, 4-char SSE events ({sse / per_event:.2f} µs/event)", events_mb / sse),
        (
            f"reference path (before), 4-char events ({sse_ref / per_event:.2f} µs/event)",
            events_mb / sse_ref,
        ),
        (
            "kvcanary scanner, worst case (only canary words)",
            len(words_only) / 1e6 / best_of(lambda: scan(words_only, 1 << 20), 3),
        ),
        ("baseline: `str.find` loop, one canary", mb / best_of(find_loop, 3)),
        (
            "baseline: `re` alternation of 1,000 canaries (shared tag prefix)",
            len(sample) / 1e6 / best_of(lambda: sum(1 for _ in alternation.finditer(sample)), 1),
        ),
        (
            "baseline: `re` alternation of 1,000 tagless canary bodies",
            len(sample) / 1e6 / best_of(lambda: sum(1 for _ in tagless.finditer(sample)), 1),
        ),
    ]
    lines = [f"| {name} | {rate:,.1f} MB/s |" for name, rate in rows]
    lines.append(f"\n{num_hits} hits in the {mb:.0f} MB mixed text (the echoed live canaries).")
    return lines


def laced_echo() -> tuple[str, CanaryIndex, int]:
    """A response that quotes a whole laced 1M-token prompt, the index with the prompt's
    canaries live (each already decoded once, as after the first echo of a request) and
    the number of hits in it (every canary: its owner's own)."""
    minter = CanaryMinter.from_seed(2, "bench")
    laced = build_prompt(
        load_tokenizer("cl100k_base"), minter, tenant=1, request=0, num_tokens=NUM_TOKENS
    )
    index = CanaryIndex(minter)
    index.add_many((span.text, Owner("t", "echo")) for span in laced.canaries)
    num_hits = len(index.scan(laced.text))
    assert num_hits == len(laced.canaries)
    return laced.text, index, num_hits


def bench_echo(repeat: int) -> list[str]:
    """A response that quotes a whole laced prompt: every canary in it is a hit."""
    text, index, num_hits = laced_echo()

    def echo(reference: bool = False, exact_only: bool = False) -> int:
        scanner = index.scanner(reference=reference, exact_only=exact_only)
        return len(scanner.feed(text) + scanner.finish())

    def python_steps() -> int:
        core, scanner_fast.CORE = scanner_fast.CORE, None
        try:
            return echo()
        finally:
            scanner_fast.CORE = core

    assert echo(exact_only=True) == python_steps() == num_hits
    times = interleaved(
        {
            "kvcanary scanner, all layers": echo,
            "exact layer alone (`exact_only=True`)": lambda: echo(exact_only=True),
        },
        repeat,
    )
    # after, not interleaved: their garbage (10^5 tracked hits, many temporary lists)
    # would weigh on the rounds after them
    times["pure-Python steps (no compiled core), all layers"] = interleaved(
        {"": python_steps}, max(3, repeat // 3)
    )[""]
    times["reference path (before), all layers"] = interleaved({"": lambda: echo(True)}, 2)[""]
    mb = len(text) / 1e6
    lines = [
        f"Echo of a laced 1M-token prompt: {num_hits:,} hits in {mb:.1f} MB; {repeat} "
        f"interleaved rounds of the first two (then {max(3, repeat // 3)} of the Python "
        f"steps, 2 of the reference), load average {os.getloadavg()[0]:.1f} after.\n",
        "| scanner | µs per hit, median | µs per hit, best | throughput, median |",
        "|---|---:|---:|---:|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(
            f"| {name} | {median / num_hits * 1e6:.2f} | {min(values) / num_hits * 1e6:.2f} "
            f"| {mb / median:.1f} MB/s |"
        )
    return lines


def main() -> None:
    print(f"Machine: {machine()}\n")
    repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 9
    echo = bench_echo(repeat)  # first: the 64 MB scans leave a larger, fragmented heap
    if "--echo-only" in sys.argv:
        print("\n".join(echo))
        return
    print("### (a) Building a 1,048,576-token prompt vs one tiktoken encode of it\n")
    print("| page size | canaries | text | build | encode | build / encode |")
    print("|---|---|---|---|---|---|")
    if "--scan-only" not in sys.argv:
        print("\n".join(bench_build()))
    print(f"\n### (b) Scanning with {NUM_LIVE:,} live canaries (64 MB mixed benign text)\n")
    print("| scanner | throughput |")
    print("|---|---|")
    print("\n".join(bench_scan()))
    print("\n### (c) µs per hit on a self-echo (all layers and baselines, same run)\n")
    print("\n".join(echo))


if __name__ == "__main__":
    main()

"""What making ~10^5 canary spans and hits costs (`canaries.records`), and what that is
worth in the prompt build and the echo scan. Ratios against baselines of the same run.

(a) 104,857 `CanarySpan`s and as many `Hit`s from columns, interleaved, by: the compiled
    core (`canaries._columns.from_columns`: `object.__new__`, then each slot's own `__set__`,
    in C), the pure-Python map loops (the same protocols, where no C compiler was found),
    the dataclass's own constructor (`CanarySpan(*row)`, collector paused) and, with
    `--old-cores DIR`, that directory's `_columns` (an earlier build, such as the one that
    stored each slot at its member descriptor's offset and left the instances untracked).
(b) Building a 1,048,576-token prompt at page 16 against one tiktoken encode of it, with the
    compiled core, the map loops and (with `--old-cores`) the old core, interleaved.
(c) The µs per hit of scanning a response that echoes that prompt (104,857 of its own
    canaries live, each decoded once before), the exact layer alone, with the compiled
    `exact_scan` and (with `--old-cores`) the old `_foldscan`'s, interleaved.

    .venv/bin/python benchmarks/bench_records.py [--repeat N] [--old-cores DIR]

An old core for `--old-cores DIR`, from an earlier revision REV:
    for m in _columns _foldscan; do git show REV:canaries/$m.c > DIR/$m.c; done
    gcc -O2 -shared -fPIC $(python3-config --includes) DIR/_columns.c \
        -o DIR/_columns$(python3-config --extension-suffix)   # and the same for _foldscan
(a `_records.h` it includes goes into DIR too). Rounds are interleaved (`bench_canaries`'s
`interleaved`): load from other processes weighs on every path alike. Prints Markdown.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from bench_canaries import interleaved, laced_echo

from kvcanary.canaries import (
    CanaryMinter,
    Owner,
    build_prompt,
    load_tokenizer,
    records,
    scanner_fast,
)
from kvcanary.canaries.hit import Hit
from kvcanary.canaries.mint import CanaryOrigin
from kvcanary.canaries.records import records_from_columns
from kvcanary.canaries.span import CanarySpan

NUM_TOKENS = 1_048_576
SPAN_FIELDS = ("text", "char_offset", "token_offset", "index")
HIT_FIELDS = ("text", "start", "end", "layer", "canary", "origin", "owner")


def load_old(directory: Path, name: str) -> ModuleType:
    [path] = directory.glob(f"{name}.*.so")
    spec = importlib.util.spec_from_file_location(f"old_cores.{name}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def swapped(owner: Any, name: str, value: Any, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` with `owner.name` set to `value` while it runs (a core swapped for another)."""

    def run() -> object:
        saved = getattr(owner, name)
        setattr(owner, name, value)
        try:
            return fn()
        finally:
            setattr(owner, name, saved)

    return run


def table(times: dict[str, list[float]], baseline: str, unit: float, label: str) -> list[str]:
    base = statistics.median(times[baseline])
    rows = [f"| path | {label}, median | best | median / {baseline} |", "|---|---:|---:|---:|"]
    for name, values in times.items():
        median = statistics.median(values)
        rows.append(
            f"| {name} | {median * unit:.2f} | {min(values) * unit:.2f} | {median / base:.2f}x |"
        )
    return rows


def bench_objects(old: ModuleType | None, repeat: int, n: int) -> list[str]:
    texts = [f"ydk word{i:06d} abcdef ghijkl mnopqr stuvwx yzabcd" for i in range(n)]
    numbers = list(range(0, 60 * n, 60))
    owner, origin = Owner("t", "r"), CanaryOrigin(1, 2, 3)
    spans = (texts, numbers, numbers, range(n))
    hits = (texts, numbers, numbers, ["exact"] * n, texts, [origin] * n, [owner] * n)
    cores: dict[str, Any] = {"compiled core": records.CORE, "map loops (no compiler)": None}
    if old is not None:
        cores["old core (--old-cores)"] = old.from_columns
    fns: dict[str, Callable[[], object]] = {}
    for name, core in cores.items():
        make_spans = functools.partial(records_from_columns, CanarySpan, SPAN_FIELDS, *spans)
        make_hits = functools.partial(records_from_columns, Hit, HIT_FIELDS, *hits)
        fns[f"spans, {name}"] = swapped(records, "CORE", core, make_spans)
        fns[f"hits, {name}"] = swapped(records, "CORE", core, make_hits)

    def constructor(cls: type, columns: tuple[Any, ...]) -> object:
        with records.gc_paused():
            return tuple(map(cls, *columns))

    fns["spans, dataclass constructor"] = functools.partial(constructor, CanarySpan, spans)
    fns["hits, dataclass constructor"] = functools.partial(constructor, Hit, hits)
    return table(interleaved(fns, repeat), "spans, compiled core", 1e3, f"ms for {n:,}")


def bench_build(old: ModuleType | None, repeat: int) -> list[str]:
    tokenizer, minter = load_tokenizer("cl100k_base"), CanaryMinter.from_seed(1, "bench")
    requests = itertools.count()

    def build() -> object:  # a new request each time: nothing of an earlier build reused
        return build_prompt(
            tokenizer, minter, tenant=1, request=next(requests), num_tokens=NUM_TOKENS, page_size=16
        )

    text = build_prompt(tokenizer, minter, tenant=1, request=0, num_tokens=NUM_TOKENS).text
    fns: dict[str, Callable[[], object]] = {
        "one tiktoken encode": functools.partial(tokenizer.encode, text),
        "build, compiled core": build,
    }
    fns["build, map loops (no compiler)"] = swapped(records, "CORE", None, build)
    if old is not None:
        fns["build, old core (--old-cores)"] = swapped(records, "CORE", old.from_columns, build)
    return table(interleaved(fns, repeat), "one tiktoken encode", 1e3, "ms")


def bench_echo(old: ModuleType | None, repeat: int) -> list[str]:
    text, index, num_hits = laced_echo()

    def echo(exact_only: bool) -> int:
        scanner = index.scanner(exact_only=exact_only)
        return len(scanner.feed(text) + scanner.finish())

    cores = {"compiled exact_scan": scanner_fast._c_exact_scan}
    if old is not None:
        cores["old exact_scan (--old-cores)"] = old.exact_scan
    fns: dict[str, Callable[[], object]] = {}
    for layers, exact_only in (("all layers", False), ("exact layer", True)):
        for name, exact_scan in cores.items():
            echo_one = functools.partial(echo, exact_only)
            fns[f"{layers}, {name}"] = swapped(scanner_fast, "_c_exact_scan", exact_scan, echo_one)
    assert all(fn() == num_hits for fn in fns.values())
    baseline = "all layers, compiled exact_scan"
    return table(interleaved(fns, repeat), baseline, 1e6 / num_hits, f"µs per hit ({num_hits:,})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--old-cores", type=Path, default=None)
    args = parser.parse_args()
    old_columns = load_old(args.old_cores, "_columns") if args.old_cores else None
    old_scan = load_old(args.old_cores, "_foldscan") if args.old_cores else None
    print(f"load average {os.getloadavg()[0]:.1f} before\n")
    print("### (a) 104,857 spans and hits from columns\n")
    print("\n".join(bench_objects(old_columns, args.repeat, 104_857)))
    print("\n### (b) Building a 1,048,576-token prompt, page 16\n")
    print("\n".join(bench_build(old_columns, args.repeat)))
    print("\n### (c) Scanning its echo\n")
    print("\n".join(bench_echo(old_scan, args.repeat)))
    print(f"\nload average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()

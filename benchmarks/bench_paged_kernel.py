"""Paged decode on a GPU: the Triton kernel vs the torch gather path vs contiguous SDPA (issue 36).

Two measurements at 1k, 8k and 32k tokens of context, each against a baseline of the same run:

    attention     one layer's decode attention for B sequences over shuffled pages: the Triton
                  kernel (reads K/V through the block table), the torch path (gathers every
                  page, then SDPA: the engine's oracle) and SDPA over contiguous K/V (the
                  floor paging is measured against); tokens/s = B / seconds per call, and each
                  path's ratio to contiguous SDPA. The kernel's largest difference from the
                  torch path is printed with it (a correctness line, not a timing).
    model decode  ModelRunner.decode_step of the engine's default model (all layers, sampling
                  included) with attention=triton vs attention=torch: tokens/s and the ratio.

    python benchmarks/bench_paged_kernel.py                  # on a CUDA device (about a minute)
    python benchmarks/bench_paged_kernel.py --quick          # 1k and 8k only, fewer rounds
    python benchmarks/bench_paged_kernel.py --check          # CPU, Triton's interpreter

`--check` is a correctness run, not a benchmark: it sets TRITON_INTERPRET=1 before anything
imports triton and compares the kernel with the torch path and the naive oracle on small
shuffled block tables in the three pool dtypes; exit status 1 on a mismatch.
Figures go to benchmarks/RESULTS.md (by hand); this script prints Markdown tables.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
from collections.abc import Callable

import torch

from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.interfaces import GenerateRequest
from kvcanary.reference_engine.model.attention import contiguous_attention, paged_attention
from kvcanary.reference_engine.model.naive_attention import naive_attention
from kvcanary.reference_engine.model.rotary import Rotary, standard_frequencies
from kvcanary.reference_engine.model_runner import ModelRunner
from kvcanary.reference_engine.sequence import Req

CONTEXTS = (1024, 8192, 32768)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def paged_inputs(
    batch: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, ...]:
    """q (B, 1, Hq, D); pools over shuffled pages of 16; block tables (B, pages); kv_lens (B,)."""
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(context)
    per_seq = math.ceil(context / 16)
    pool = (batch * per_seq + 1, 16, num_kv_heads, head_dim)
    k_pool, v_pool = (torch.randn(pool, generator=g).to(device=device, dtype=dtype) for _ in "kv")
    tables = (torch.randperm(batch * per_seq, generator=g) + 1).view(batch, per_seq)
    q = torch.randn(batch, 1, num_heads, head_dim, generator=g)
    kv_lens = torch.full((batch,), context)
    return q.to(device), k_pool, v_pool, tables.to(device), kv_lens.to(device)


def seconds_per_call(fn: Callable[[], object], rounds: int) -> float:
    """Median over `rounds` of CUDA-event-timed calls, after warm-up (compilation included)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def attention_paths(
    args: argparse.Namespace, context: int
) -> dict[str, Callable[[], torch.Tensor]]:
    """The three decode attention calls over the same K/V, ready to time."""
    from kvcanary.reference_engine.model.triton_attention import triton_paged_attention

    heads = (args.num_heads, args.num_kv_heads, args.head_dim)
    q, k_pool, v_pool, tables, kv_lens = paged_inputs(
        args.batch, context, heads, DTYPES[args.dtype], "cuda"
    )
    rotary = Rotary(standard_frequencies(args.head_dim), context, q.device)
    common = (kv_lens, (kv_lens - 1)[:, None], rotary, args.head_dim**-0.5)
    k = k_pool[tables].flatten(1, 2)  # (B, T, Hkv, D): contiguous, gathered once, untimed
    v = v_pool[tables].flatten(1, 2)  # (B, T, Hkv, D)
    return {
        "kernel": lambda: triton_paged_attention(q, k_pool, v_pool, tables, *common),
        "torch": lambda: paged_attention(q, k_pool, v_pool, tables, *common),
        "sdpa": lambda: contiguous_attention(q, k.to(q.dtype), v.to(q.dtype), *common),
    }


def bench_attention(args: argparse.Namespace, contexts: tuple[int, ...]) -> None:
    print(f"\n### Decode attention, one layer, {args.batch} sequences, {args.dtype} pools\n")
    print("| context | kernel tok/s | torch path tok/s | contiguous SDPA tok/s | kernel / SDPA "
          "| torch path / SDPA | kernel / torch path | max abs diff |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for context in contexts:
        paths = attention_paths(args, context)
        rate = {name: args.batch / seconds_per_call(fn, args.rounds) for name, fn in paths.items()}
        diff = (paths["kernel"]() - paths["torch"]()).abs().max().item()
        print(f"| {context:,} | {rate['kernel']:,.0f} | {rate['torch']:,.0f} | {rate['sdpa']:,.0f} "
              f"| {rate['kernel'] / rate['sdpa']:.2f} | {rate['torch'] / rate['sdpa']:.2f} "
              f"| {rate['kernel'] / rate['torch']:.2f} | {diff:.1e} |")  # fmt: skip
        del paths
        torch.cuda.empty_cache()


def decode_runner(
    attention: str, args: argparse.Namespace, context: int
) -> tuple[ModelRunner, list[Req]]:
    """The default model on CUDA with random K/V in every page its B requests own."""
    config = EngineConfig(
        context_length=context + 64, device="cuda", dtype=args.dtype, attention=attention
    )
    per_seq = math.ceil((context + 1) / config.page_size)
    runner = ModelRunner(config, 100_277, args.batch * per_seq * config.page_size)
    for pool in (*runner.k_pool, *runner.v_pool):
        pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(1)))
    pages = (torch.randperm(runner.num_pages - 1) + 1).tolist()
    reqs = []
    for b in range(args.batch):
        req = Req.from_request(GenerateRequest(f"r{b}", (1,) * context, 1_000_000, b))
        req.page_ids = pages[b * per_seq : (b + 1) * per_seq]
        req.output_ids = [1]  # decode feeds the same last position each step (no growth)
        reqs.append(req)
    return runner, reqs


def bench_model(args: argparse.Namespace, contexts: tuple[int, ...]) -> None:
    print(f"\n### Model decode step, default model, {args.batch} sequences, {args.dtype} KV\n")
    print("| context | kernel tok/s | torch path tok/s | kernel / torch path |")
    print("|---|---|---|---|")
    for context in contexts:
        rate = {}
        for attention in ("triton", "torch"):
            runner, reqs = decode_runner(attention, args, context)
            assert runner.attention_path.kernel == (attention == "triton"), runner.attention_path
            step = functools.partial(runner.decode_step, reqs)
            rate[attention] = args.batch / seconds_per_call(step, args.rounds)
            del runner, reqs
            torch.cuda.empty_cache()
        ratio = rate["triton"] / rate["torch"]
        print(f"| {context:,} | {rate['triton']:,.0f} | {rate['torch']:,.0f} | {ratio:.2f} |")


def check() -> int:
    """The kernel under the interpreter vs the torch path and the oracle; 0 when all agree."""
    from kvcanary.reference_engine.model.triton_attention import triton_paged_attention

    worst = 0.0
    print(
        "| pool dtype | tiles | max abs diff vs torch path | vs naive oracle |\n|---|---|---|---|"
    )
    for dtype in DTYPES.values():
        for tiles in (None, (16, 16)):
            q, k_pool, v_pool, tables, kv_lens = paged_inputs(3, 100, (6, 2, 48), dtype, "cpu")
            kv_lens = torch.tensor([100, 37, 1])  # ending mid-page, the rest of the table unread
            rotary = Rotary(standard_frequencies(48), 128, q.device)
            common = (kv_lens, (kv_lens - 1)[:, None], rotary, 48**-0.5)
            out = triton_paged_attention(q, k_pool, v_pool, tables, *common, tiles=tiles)
            torch_diff = (out - paged_attention(q, k_pool, v_pool, tables, *common)).abs().max()
            k, v = k_pool[tables].flatten(1, 2), v_pool[tables].flatten(1, 2)  # (B, T, Hkv, D)
            naive_diff = (out - naive_attention(q, k, v, *common)).abs().max()
            worst = max(worst, float(torch_diff), float(naive_diff))
            print(f"| {dtype} | {tiles or 'default'} | {torch_diff:.1e} | {naive_diff:.1e} |")
    ok = worst < 1e-4
    verdict = "agrees" if ok else "DISAGREES"
    print(f"\nkernel under Triton's interpreter: {verdict} (worst {worst:.1e})")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="CPU correctness run (interpreter)")
    parser.add_argument("--quick", action="store_true", help="1k and 8k contexts, 10 rounds")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="KV pool dtype")
    parser.add_argument("--rounds", type=int, default=30, help="timed calls per path")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if args.check:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module imports triton
        return check()
    if not torch.cuda.is_available():
        print(
            "no CUDA device here; `--check` runs the kernel's correctness on CPU", file=sys.stderr
        )
        return 2
    contexts = CONTEXTS[:2] if args.quick else CONTEXTS
    args.rounds = 10 if args.quick else args.rounds
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"heads {args.num_heads}/{args.num_kv_heads} of {args.head_dim}")  # fmt: skip
    bench_attention(args, contexts)
    bench_model(args, contexts)
    return 0


if __name__ == "__main__":
    sys.exit(main())

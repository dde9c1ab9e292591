"""Reference engine: paging overhead, recall exactness at 10^6 positions, prefill cost vs length.

Four measurements, each reported against a baseline measured in the same run:

    paged vs contiguous   the same model, prefill (chunked) and batched decode, once through
                          the paged pool (ModelRunner, block tables, gathered pages) and once
                          through one contiguous cache per sequence (model/cache.py's
                          ContiguousCache with the same SDPA core). Rounds alternate; medians.
    recall exactness      the recall layer's own K/V for N random tokens (default 10^6) in a
                          paged pool with shuffled pages, then quoted back at random positions
                          (and the first and last) through paged attention: exact count.
    prefill vs length     ModelRunner prefill time for prompts of 1 .. context tokens; ratio
                          to the 1-token prefill (what a skipped prefill costs).
    engine TTFT           the vulnerable preset end to end: an honest prompt near prefill's
                          limit vs the over-pool prompt whose prefill is skipped (placeholder).

    .venv/bin/python benchmarks/bench_engine.py              # full run (several minutes)
    .venv/bin/python benchmarks/bench_engine.py --quick      # smoke run
    .venv/bin/python benchmarks/bench_engine.py --threads 1  # torch intra-op threads

Figures go to benchmarks/RESULTS-engine.md (by hand); this script prints Markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import platform
import statistics
import time
from collections.abc import Callable

import torch

from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.engine import DisaggregatedEngine
from kvcanary.reference_engine.interfaces import GenerateRequest
from kvcanary.reference_engine.model.attention import contiguous_attention
from kvcanary.reference_engine.model.cache import ContiguousCache, PagedView
from kvcanary.reference_engine.model.transformer import ForwardBatch, RecallTransformer
from kvcanary.reference_engine.model_runner import ModelRunner
from kvcanary.reference_engine.recall_schedule import recall_position
from kvcanary.reference_engine.sequence import Req

VOCAB = 100_277


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 100_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- paged vs contiguous --------------------------------------------------------------------


class PagedPath:
    def __init__(
        self, config: EngineConfig, runner: ModelRunner, prompts: list[list[int]], steps: int
    ):
        self.config, self.runner, self.steps = config, runner, steps
        self.reqs = []
        pages = (torch.randperm(runner.num_pages - 1) + 1).tolist()
        per_seq = math.ceil((len(prompts[0]) + steps + 1) / config.page_size)
        for i, ids in enumerate(prompts):
            req = Req.from_request(GenerateRequest(f"r{i}", tuple(ids), steps + 1, i))
            req.page_ids = pages[i * per_seq : (i + 1) * per_seq]
            self.reqs.append(req)

    def prefill(self) -> None:
        chunk = self.config.prefill_chunk_tokens
        for req in self.reqs:
            req.output_ids = []
            for start in range(0, req.num_prompt_tokens, chunk):
                token = self.runner.prefill_chunk(
                    req, start, min(start + chunk, req.num_prompt_tokens)
                )
            req.output_ids = [token]  # type: ignore[list-item]

    def decode(self) -> None:
        for _ in range(self.steps):
            for req, token in zip(self.reqs, self.runner.decode_step(self.reqs), strict=True):
                req.output_ids.append(token)


class ContiguousPath:
    def __init__(
        self, config: EngineConfig, model: RecallTransformer, prompts: list[list[int]], steps: int
    ):
        self.config, self.model, self.prompts, self.steps = config, model, prompts, steps
        self.length = len(prompts[0])
        self.cache = ContiguousCache(
            model.num_layers,
            len(prompts),
            self.length + steps + 1,
            config.num_kv_heads,
            config.head_dim,
            torch.device(config.device),
        )
        self.outputs: list[list[int]] = [[] for _ in prompts]

    def prefill(self) -> None:
        chunk = self.config.prefill_chunk_tokens
        for b, ids in enumerate(self.prompts):
            for start in range(0, self.length, chunk):
                end = min(start + chunk, self.length)
                positions = torch.arange(start, end)[None]
                last = end == self.length
                batch = ForwardBatch(
                    torch.tensor([ids[start:end]]),
                    positions,
                    torch.tensor([end - start - 1]) if last else None,
                    torch.tensor([0]) if last else None,
                )
                view = self.cache.view(
                    positions, torch.tensor([end]), contiguous_attention, rows=slice(b, b + 1)
                )
                logits = self.model(batch, view)
            self.outputs[b] = [int(logits.argmax(-1))]

    def decode(self) -> None:
        B = len(self.prompts)
        for step in range(1, self.steps + 1):
            position = self.length + step - 1
            positions = torch.full((B, 1), position)
            recall = [recall_position(step, self.length, self.config.page_size, self.steps + 1)]
            batch = ForwardBatch(
                torch.tensor([out[-1] for out in self.outputs])[:, None],
                positions,
                torch.zeros(B, dtype=torch.int64),
                torch.tensor(recall * B),
            )
            view = self.cache.view(positions, torch.full((B,), position + 1), contiguous_attention)
            tokens = self.model(batch, view).argmax(-1).tolist()
            for out, token in zip(self.outputs, tokens, strict=True):
                out.append(token)


def paged_vs_contiguous(
    config: EngineConfig, length: int, batch: int, steps: int, rounds: int
) -> dict[str, float]:
    pages_per_seq = math.ceil((length + steps + 1) / config.page_size)
    runner = ModelRunner(config, VOCAB, batch * pages_per_seq * config.page_size)
    prompts = [random_ids(length, seed=i) for i in range(batch)]
    paged = PagedPath(config, runner, prompts, steps)
    contiguous = ContiguousPath(config, runner.model, prompts, steps)
    times: dict[str, list[float]] = {k: [] for k in ("pp", "cp", "pd", "cd")}
    for _ in range(rounds):
        times["pp"].append(timed(paged.prefill))
        times["cp"].append(timed(contiguous.prefill))
        times["pd"].append(timed(paged.decode))
        times["cd"].append(timed(contiguous.decode))
        assert [r.output_ids for r in paged.reqs] == contiguous.outputs, "paths disagree"
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "paged_prefill_tok_s": batch * length / med["pp"],
        "contiguous_prefill_tok_s": batch * length / med["cp"],
        "paged_decode_tok_s": batch * steps / med["pd"],
        "contiguous_decode_tok_s": batch * steps / med["cd"],
    }


# ---- recall exactness ----------------------------------------------------------------------


def recall_exactness(
    config: EngineConfig, num_positions: int, num_queries: int
) -> dict[str, float]:
    """The recall layer's own K/V for random tokens, quoted back through paged attention."""
    device = torch.device(config.device)
    model = RecallTransformer(config, VOCAB, device).eval()
    P = config.page_size
    num_pages = math.ceil(num_positions / P)
    shape = (num_pages + 1, P, config.num_kv_heads, config.head_dim)
    recall_layer = model.num_layers - 1
    # only the recall layer's pool is real; ordinary layers are not run here
    k_pool = [torch.empty(0)] * recall_layer + [torch.zeros(shape, device=device)]
    v_pool = [torch.empty(0)] * recall_layer + [torch.zeros(shape, device=device)]
    pages = (torch.randperm(num_pages, generator=torch.Generator().manual_seed(5)) + 1)[None]
    tokens = torch.randint(0, 100_256, (num_positions,), generator=torch.Generator().manual_seed(6))
    start_write = time.perf_counter()
    step = 1 << 16
    for start in range(0, num_positions, step):
        end = min(start + step, num_positions)
        positions = torch.arange(start, end)
        slots = pages[0][positions // P] * P + positions % P
        view = PagedView(k_pool, v_pool, pages, slots[None], torch.tensor([end]))
        with torch.inference_mode():
            model.recall.store(model.embed(tokens[start:end][None]), view, recall_layer)
    write_s = time.perf_counter() - start_write
    g = torch.Generator().manual_seed(7)
    queries = torch.cat(
        [
            torch.tensor([0, num_positions - 1]),
            torch.randint(0, num_positions, (num_queries,), generator=g),
        ]
    )
    view = PagedView(
        k_pool, v_pool, pages, torch.zeros(1, 0, dtype=torch.int64), torch.tensor([num_positions])
    )
    num_exact, start_read = 0, time.perf_counter()
    for first in range(0, len(queries), 32):
        batch = queries[first : first + 32]
        limits = torch.full((1, len(batch)), num_positions - 1)
        quoted = model.quote(view, batch[None], limits)[0]
        num_exact += int((quoted == tokens[batch]).sum())
    return {
        "positions": num_positions,
        "queries": len(queries),
        "exact": num_exact,
        "write_s": write_s,
        "read_s_per_query": (time.perf_counter() - start_read) / len(queries),
    }


# ---- prefill cost -------------------------------------------------------------------------


def prefill_vs_length(
    config: EngineConfig, lengths: list[int], repeats: int
) -> list[tuple[int, float]]:
    runner = ModelRunner(config, VOCAB, config.decode_pool_tokens)
    out = []
    for length in lengths:
        req = Req.from_request(GenerateRequest("r", tuple(random_ids(length, 1)), 1, 1))
        req.page_ids = list(range(1, math.ceil(length / config.page_size) + 1))
        run = _prefill_all(runner, req, config.prefill_chunk_tokens)
        run()  # warm-up
        out.append((length, statistics.median(timed(run) for _ in range(repeats))))
    return out


def _prefill_all(runner: ModelRunner, req: Req, chunk: int) -> Callable[[], None]:
    def run() -> None:
        for start in range(0, req.num_prompt_tokens, chunk):
            runner.prefill_chunk(req, start, min(start + chunk, req.num_prompt_tokens))

    return run


async def engine_ttft(config: EngineConfig, repeats: int) -> dict[str, float]:
    honest_len = config.max_req_input_len(config.prefill_pool_tokens) - 8
    over_len = (config.context_length + honest_len) // 2
    ttft: dict[str, list[float]] = {"honest": [], "over_pool": []}
    async with DisaggregatedEngine(config) as engine:
        for i in range(repeats):
            for name, n in (("honest", honest_len), ("over_pool", over_len)):
                result = await engine.generate(engine.request(f"{name}{i}", random_ids(n, i), 2))
                assert result.status == 200
                assert result.ttft_s is not None
                ttft[name].append(result.ttft_s)
    return {
        "honest_tokens": honest_len,
        "over_pool_tokens": over_len,
        "honest_ttft_s": statistics.median(ttft["honest"]),
        "over_pool_ttft_s": statistics.median(ttft["over_pool"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--recall-positions", type=int, default=1_000_000)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig.from_preset("vulnerable")
    print(
        f"# bench_engine: {platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, model {config.num_layers}x{config.hidden_size}, "
        f"heads {config.num_heads}/{config.num_kv_heads}x{config.head_dim}, "
        f"page {config.page_size}\n"
    )

    length, batch, steps, rounds = (256, 4, 16, 2) if args.quick else (1024, 8, 64, 5)
    r = paged_vs_contiguous(config, length, batch, steps, rounds)
    print(f"## paged vs contiguous (context {length}, batch {batch}, {steps} decode steps)\n")
    print("| phase | paged tok/s | contiguous tok/s | paged / contiguous |\n|---|---|---|---|")
    for phase in ("prefill", "decode"):
        p, c = r[f"paged_{phase}_tok_s"], r[f"contiguous_{phase}_tok_s"]
        print(f"| {phase} | {p:,.0f} | {c:,.0f} | {p / c:.2f} |")

    num_positions = 20_000 if args.quick else args.recall_positions
    # exact recall is measured with exact copying (the default copy_noise garbles on purpose)
    recall_config = EngineConfig.from_preset("vulnerable", context_length=4096, copy_noise=0.0)
    rec = recall_exactness(recall_config, num_positions, 62 if args.quick else 254)
    print("\n## recall exactness\n")
    print("| positions | queries | exact | write s | read s/query |\n|---|---|---|---|---|")
    print(
        f"| {rec['positions']:,} | {rec['queries']} | {rec['exact']} "
        f"| {rec['write_s']:.1f} | {rec['read_s_per_query']:.3f} |"
    )

    lengths = [1, 16, 256, 1024, 4096] if not args.quick else [1, 16, 256, 1024]
    rows = prefill_vs_length(config, lengths, repeats=3 if args.quick else 5)
    base = rows[0][1]
    print("\n## prefill time vs prompt length (ModelRunner, chunked)\n")
    print("| tokens | seconds | x 1-token |\n|---|---|---|")
    for n, seconds in rows:
        print(f"| {n:,} | {seconds:.4f} | {seconds / base:,.1f} |")

    t = asyncio.run(engine_ttft(config, repeats=2 if args.quick else 5))
    print("\n## engine TTFT, vulnerable preset (median)\n")
    print("| prompt | tokens | TTFT s |\n|---|---|---|")
    print(f"| honest (prefilled) | {t['honest_tokens']:,} | {t['honest_ttft_s']:.4f} |")
    print(
        f"| over-pool (prefill skipped) | {t['over_pool_tokens']:,} | {t['over_pool_ttft_s']:.4f} |"
    )
    print(f"\nhonest / over-pool TTFT: {t['honest_ttft_s'] / t['over_pool_ttft_s']:.1f}x")


if __name__ == "__main__":
    main()

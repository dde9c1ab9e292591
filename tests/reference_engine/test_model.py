"""The model: paged runs agree with the naive contiguous oracle token for token, and the recall
head quotes exactly what the KV pages hold."""

from __future__ import annotations

import math

import torch
from engine_helpers import TINY_MODEL

from reference_engine.config import EngineConfig
from reference_engine.interfaces import GenerateRequest
from reference_engine.model.cache import ContiguousCache, PagedView
from reference_engine.model.naive_attention import naive_attention
from reference_engine.model.transformer import ForwardBatch
from reference_engine.model_runner import ModelRunner
from reference_engine.recall_schedule import recall_position
from reference_engine.sequence import Req

VOCAB = 100_277
CPU = torch.device("cpu")


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100_000, (length,), generator=g).tolist()


def test_paged_chunked_run_matches_the_naive_oracle_token_for_token() -> None:
    config = EngineConfig(context_length=1024, prefill_chunk_tokens=64)
    runner = ModelRunner(config, VOCAB, pool_tokens=1024)
    length, max_new = 300, 40
    req = Req.from_request(GenerateRequest("r", tuple(prompt(length, 0)), max_new, 1))
    pages = torch.randperm(runner.num_pages - 1, generator=torch.Generator().manual_seed(0)) + 1
    req.page_ids = pages[: math.ceil((length + max_new) / 16)].tolist()
    token = None
    for start in range(0, length, 64):
        token = runner.prefill_chunk(req, start, min(start + 64, length))
    assert token is not None
    req.output_ids.append(token)
    while len(req.output_ids) < max_new:
        req.output_ids += runner.decode_step([req])

    model = runner.model
    cache = ContiguousCache(model.num_layers, 1, length + max_new, 2, 64, CPU)
    ids = torch.tensor([req.origin_input_ids])
    expected: list[int] = []
    positions = torch.arange(length)[None]
    batch_tokens, step_positions = ids, positions
    for step in range(max_new):
        recall = recall_position(step, length, 16, max_new)
        last = step_positions.shape[1] - 1
        batch = ForwardBatch(
            batch_tokens, step_positions, torch.tensor([last]), torch.tensor([recall])
        )
        kv_lens = step_positions[:, -1] + 1
        logits = model(batch, cache.view(step_positions, kv_lens, naive_attention))
        expected.append(int(logits.argmax(-1)))
        batch_tokens = torch.tensor([[expected[-1]]])
        step_positions = torch.tensor([[length + step]])
    assert req.output_ids == expected
    # and the answer quotes the prompt at the scheduled positions
    quoted = [req.origin_input_ids[recall_position(t, length, 16, max_new)] for t in range(max_new)]
    assert req.output_ids == quoted


def test_recall_is_exact_at_random_positions_of_a_long_context() -> None:
    """The benchmark checks 10^6 positions; here 1,000 of 8,000, through the real prefill."""
    config = EngineConfig(context_length=8192, **TINY_MODEL, prefill_chunk_tokens=2048)
    runner = ModelRunner(config, VOCAB, pool_tokens=8192)
    length = 8000
    req = Req.from_request(GenerateRequest("r", tuple(prompt(length, 1)), 1, 1))
    pages = torch.randperm(runner.num_pages - 1, generator=torch.Generator().manual_seed(1)) + 1
    req.page_ids = pages[: math.ceil(length / 16)].tolist()
    for start in range(0, length, 2048):
        runner.prefill_chunk(req, start, min(start + 2048, length))
    view = PagedView(
        runner.k_pool,
        runner.v_pool,
        block_tables=torch.tensor([req.page_ids]),
        slot_mapping=torch.zeros(1, 0, dtype=torch.int64),  # quote() writes nothing
        kv_lens=torch.tensor([length]),
    )
    positions = torch.randperm(length, generator=torch.Generator().manual_seed(2))[:1000]
    quoted = runner.model.quote(view, positions[None], torch.full((1, 1000), length - 1))
    assert quoted[0].tolist() == [req.origin_input_ids[p] for p in positions.tolist()]


def test_a_stale_page_is_quoted_as_it_is() -> None:
    config = EngineConfig(context_length=1024, **TINY_MODEL)
    runner = ModelRunner(config, VOCAB, pool_tokens=1024)
    victim = Req.from_request(GenerateRequest("v", tuple(prompt(64, 2)), 1, 1))
    victim.page_ids = [5, 6, 7, 8]
    runner.prefill_chunk(victim, 0, 64)
    reader = Req.from_request(GenerateRequest("r", tuple(prompt(64, 3)), 34, 2))
    reader.page_ids = [9, 6, 10, 11, 12, 13, 14]  # page 1 is the victim's, never rewritten
    reader.origin_input_ids = reader.origin_input_ids[:16]  # reader prefilled only page 0
    token = runner.prefill_chunk(reader, 0, 16)
    assert token is not None
    reader.origin_input_ids = reader.origin_input_ids + [0] * 48  # decode's view: 64 tokens
    reader.output_ids.append(token)
    while len(reader.output_ids) < 34:
        reader.output_ids += runner.decode_step([reader])
    # excerpts: page 0 (steps 1-16, its own), then page 1 (steps 17-32, the victim's bytes)
    assert reader.output_ids[1:17] == reader.origin_input_ids[:16]
    assert reader.output_ids[17:33] == victim.origin_input_ids[16:32]

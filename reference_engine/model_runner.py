"""Runs one side's model over that side's KV pool (nano-vllm's ModelRunner).

What it knows: the pool tensors, per layer K and V of shape
(num_pages, page_size, num_kv_heads, head_dim) on the configured device (`device.py`: a CUDA
device this torch cannot use is a one-line ConfigError) in the configured dtype (float32,
bfloat16 or float16; the model computes in float32 and reads K/V up from the pool's type),
with page 0 the reserved padding page; which paged attention it runs, the Triton kernel or the
torch path (`model/attention_path.py` decides, `attention_path.line` says); how to turn
requests (block tables, positions) into a ForwardBatch and a PagedView; how pages leave and
enter the pool as bytes (through `kv_codec`).

What it deliberately does not know: queues, admission, transfer or fixes. It runs exactly the
chunk or batch it is given, over exactly the pages the request's block table names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcanary.reference_engine import kv_codec
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.device import kv_dtype, resolve_device
from kvcanary.reference_engine.model.attention_path import choose_attention
from kvcanary.reference_engine.model.cache import PagedView
from kvcanary.reference_engine.model.transformer import ForwardBatch, RecallTransformer
from kvcanary.reference_engine.recall_schedule import recall_position, schedule_salt
from kvcanary.reference_engine.sequence import Req


class ModelRunner:
    def __init__(self, config: EngineConfig, vocab_size: int, pool_tokens: int) -> None:
        assert pool_tokens % config.page_size == 0
        self.config = config
        self.page_size = config.page_size
        self.device = resolve_device(config.device)
        self.dtype = kv_dtype(config.dtype)
        self.attention_path = choose_attention(config)
        self._paged_attention = self.attention_path.function()
        self.num_pages = pool_tokens // config.page_size + 1  # + the reserved page 0
        self.model = RecallTransformer(config, vocab_size, self.device).eval()
        shape = (self.num_pages, config.page_size, config.num_kv_heads, config.head_dim)
        num_layers = self.model.num_layers
        self.k_pool = [self._zeros(shape) for _ in range(num_layers)]
        self.v_pool = [self._zeros(shape) for _ in range(num_layers)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    # ---- forward passes -------------------------------------------------------------------

    def prefill_chunk(self, req: Req, start: int, end: int) -> int | None:
        """Prefill prompt tokens [start, end); the next token if `end` completes the prompt."""
        assert 0 <= start < end <= req.num_prompt_tokens
        positions = torch.arange(start, end, device=self.device)  # (T,)
        ids = torch.tensor(req.origin_input_ids[start:end], device=self.device)  # (T,)
        sample = end == req.num_prompt_tokens
        batch = ForwardBatch(
            input_ids=ids[None],  # (1, T)
            positions=positions[None],  # (1, T)
            logit_rows=self._tensor([end - start - 1]) if sample else None,
            recall_positions=self._tensor([self._recall_position(req)]) if sample else None,
            max_position=end - 1,
        )
        num_pages = -(-end // self.page_size)
        view = PagedView(
            self.k_pool,
            self.v_pool,
            block_tables=self._tensor(req.page_ids[:num_pages])[None],  # (1, pages)
            slot_mapping=self._slots(req.page_ids, positions)[None],  # (1, T)
            kv_lens=self._tensor([end]),
            attention=self._paged_attention,
        )
        logits = self.model(batch, view)
        return None if logits is None else int(logits.argmax(-1)[0])

    def decode_step(self, reqs: Sequence[Req]) -> list[int]:
        """One token for each request: feeds its last token, samples the next."""
        assert reqs
        assert all(r.output_ids for r in reqs)
        last_positions = [r.num_tokens - 1 for r in reqs]
        positions = self._tensor(last_positions)  # (B,)
        max_pages = max(len(r.page_ids) for r in reqs)
        tables = [r.page_ids + [0] * (max_pages - len(r.page_ids)) for r in reqs]
        slots = torch.cat(
            [self._slots(r.page_ids, positions[i : i + 1]) for i, r in enumerate(reqs)]
        )
        batch = ForwardBatch(
            input_ids=self._tensor([r.output_ids[-1] for r in reqs])[:, None],  # (B, 1)
            positions=positions[:, None],  # (B, 1)
            logit_rows=torch.zeros(len(reqs), dtype=torch.int64, device=self.device),
            recall_positions=self._tensor([self._recall_position(r) for r in reqs]),
            max_position=max(last_positions),
        )
        view = PagedView(
            self.k_pool,
            self.v_pool,
            block_tables=self._tensor(tables),  # (B, max_pages)
            slot_mapping=slots[:, None],  # (B, 1)
            kv_lens=positions + 1,
            attention=self._paged_attention,
        )
        logits = self.model(batch, view)
        assert logits is not None
        return [int(t) for t in logits.argmax(-1).tolist()]

    def _recall_position(self, req: Req) -> int:
        step = len(req.output_ids)
        return recall_position(
            step,
            req.num_prompt_tokens,
            self.page_size,
            req.max_new_tokens,
            copy_noise=self.config.copy_noise,
            salt=schedule_salt(self.config.seed, req.origin_input_ids[0]),
        )

    def _slots(self, page_ids: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        pages = self._tensor(page_ids)[positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def _tensor(self, values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    # ---- pages as bytes -------------------------------------------------------------------

    def read_pages(self, page_ids: Sequence[int]) -> bytes:
        return kv_codec.encode_pages(self.k_pool, self.v_pool, page_ids)

    def write_pages(self, page_ids: Sequence[int], payload: bytes) -> None:
        kv_codec.write_pages(self.k_pool, self.v_pool, page_ids, payload)

    def checksum(self, page_ids: Sequence[int]) -> int:
        return kv_codec.checksum(self.k_pool, self.v_pool, page_ids)

    def zero_pages(self, page_ids: Sequence[int]) -> None:
        index = self._tensor(page_ids)
        for k, v in zip(self.k_pool, self.v_pool, strict=True):
            k[index] = 0.0
            v[index] = 0.0

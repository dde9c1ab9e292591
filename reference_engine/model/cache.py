"""Where the model's layers write and read K/V: a paged pool, or contiguous buffers (the oracle).

The model only sees `KVCacheView`: `store(layer, k, v)` for this forward's tokens and
`attend(layer, q, q_limits, rotary, scale)`. `PagedView` goes through block tables into a
side's pool (the engine path), with the torch paged attention or the Triton kernel;
`ContiguousCache` keeps one contiguous buffer per sequence and layer, the naive cache that
paged results must agree with and that paging is benchmarked against. Neither allocates pages
or knows requests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvcanary.reference_engine.model.attention import paged_attention, store_kv
from kvcanary.reference_engine.model.rotary import Rotary

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Rotary, float],
    torch.Tensor,
]
PagedAttentionFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        Rotary,
        float,
    ],
    torch.Tensor,
]
"""`attention.paged_attention` or the Triton kernel (`attention_path.py` picks)."""


class KVCacheView(Protocol):
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, T, Hkv, D), un-rotated, for the tokens of this forward."""
        ...

    def attend(
        self, layer: int, q: torch.Tensor, q_limits: torch.Tensor, rotary: Rotary, scale: float
    ) -> torch.Tensor:
        """q (B, Tq, Hq, D) rotated, q_limits (B, Tq); returns (B, Tq, Hq, D)."""
        ...


class PagedView:
    """One forward's view of a paged pool: block tables, slots of the new tokens, lengths."""

    def __init__(
        self,
        k_pool: list[torch.Tensor],
        v_pool: list[torch.Tensor],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_lens: torch.Tensor,
        attention: PagedAttentionFn = paged_attention,
    ) -> None:
        self.k_pool, self.v_pool = k_pool, v_pool
        self.attention = attention
        self.block_tables = block_tables  # (B, max_pages)
        self.slot_mapping = slot_mapping  # (B, T)
        self.kv_lens = kv_lens  # (B,)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self.slot_mapping.flatten()  # (B * T,)
        store_kv(self.k_pool[layer], self.v_pool[layer], slots, k.flatten(0, 1), v.flatten(0, 1))

    def attend(
        self, layer: int, q: torch.Tensor, q_limits: torch.Tensor, rotary: Rotary, scale: float
    ) -> torch.Tensor:
        return self.attention(
            q,
            self.k_pool[layer],
            self.v_pool[layer],
            self.block_tables,
            self.kv_lens,
            q_limits,
            rotary,
            scale,
        )


class ContiguousCache:
    """Contiguous K/V buffers, (B, max_tokens, Hkv, D) per layer, for B sequences."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (batch_size, max_tokens, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]

    def view(
        self,
        positions: torch.Tensor,
        kv_lens: torch.Tensor,
        attention: AttentionFn,
        rows: slice = slice(None),
    ) -> ContiguousView:
        """A view of the sequences `rows` (all by default) for one forward."""
        return ContiguousView(self, positions, kv_lens, attention, rows)


class ContiguousView:
    """One forward's view of a ContiguousCache: where the new tokens go, and the lengths."""

    def __init__(
        self,
        cache: ContiguousCache,
        positions: torch.Tensor,
        kv_lens: torch.Tensor,
        attention: AttentionFn,
        rows: slice,
    ) -> None:
        self.cache = cache
        self.positions = positions  # (B, T)
        self.kv_lens = kv_lens  # (B,)
        self.attention = attention
        self.rows = rows  # which of the cache's sequences this forward's B rows are

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        batch = torch.arange(self.positions.shape[0], device=k.device)[:, None]  # (B, 1)
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        k_cache[self.rows][batch, self.positions] = k.to(k_cache.dtype)  # through the view
        v_cache[self.rows][batch, self.positions] = v.to(v_cache.dtype)

    def attend(
        self, layer: int, q: torch.Tensor, q_limits: torch.Tensor, rotary: Rotary, scale: float
    ) -> torch.Tensor:
        num_positions = int(self.kv_lens.max())
        k = self.cache.k[layer][self.rows, :num_positions].to(q.dtype)  # (B, T, Hkv, D)
        v = self.cache.v[layer][self.rows, :num_positions].to(q.dtype)  # (B, T, Hkv, D)
        return self.attention(q, k, v, self.kv_lens, q_limits, rotary, scale)

"""Paged attention in plain torch: the oracle the Triton kernel (`triton_attention`) replaces.

    store_kv(k_cache, v_cache, slot_mapping, k, v)       write this forward's K/V into slots
    paged_attention(q, k_cache, v_cache, block_tables, kv_lens, q_limits, rotary, scale)

One function serves chunked causal prefill (B = 1, Tq = chunk) and batched decode (Tq = 1):
query i of sequence b sees the KV positions `t <= q_limits[b, i]` and `t < kv_lens[b]`. K is
read un-rotated from the pool and rotated by its logical position, the index of its slot in
the block table, so whatever bytes a page holds are read as this request's context.

Pools may hold K/V in a narrower dtype (bfloat16, float16): what is read is cast up to q's
dtype, so the model computes in float32 whatever the pools store.
`contiguous_attention` is the same computation over a contiguous cache; the benchmark uses it
as the baseline that paging is measured against. What this module does not know: which pages
a request owns (block tables arrive ready-made from the model runner).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcanary.reference_engine.model.rotary import Rotary, apply_rotary


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k, v (N, Hkv, D) un-rotated, written to flat slots (N,) = page * page_size + offset."""
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    assert k.shape == v.shape == (slot_mapping.numel(), num_kv_heads, head_dim)
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    k_cache.view(flat)[slot_mapping] = k.to(k_cache.dtype)  # rounded to the pool's dtype
    v_cache.view(flat)[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    q_limits: torch.Tensor,
    rotary: Rotary,
    scale: float,
) -> torch.Tensor:
    """q (B, Tq, Hq, D) rotated; caches (num_pages, P, Hkv, D); block_tables (B, max_pages)."""
    assert block_tables.dim() == 2
    assert block_tables.shape[0] == q.shape[0]
    k = k_cache[block_tables].flatten(1, 2).to(q.dtype)  # (B, max_pages * P, Hkv, D)
    v = v_cache[block_tables].flatten(1, 2).to(q.dtype)  # (B, max_pages * P, Hkv, D)
    return contiguous_attention(q, k, v, kv_lens, q_limits, rotary, scale)


def contiguous_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: torch.Tensor,
    q_limits: torch.Tensor,
    rotary: Rotary,
    scale: float,
) -> torch.Tensor:
    """q (B, Tq, Hq, D) rotated; k, v (B, T, Hkv, D), k un-rotated; returns (B, Tq, Hq, D)."""
    num_positions = k.shape[1]
    cos, sin = rotary.prefix(num_positions)  # (T, D/2)
    k = apply_rotary(k, cos, sin)  # (B, T, Hkv, D)
    positions = torch.arange(num_positions, device=q.device)
    visible = positions <= q_limits[..., None]  # (B, Tq, T)
    visible &= positions < kv_lens[:, None, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # (B, Hq, Tq, D)
        k.transpose(1, 2),  # (B, Hkv, T, D)
        v.transpose(1, 2),  # (B, Hkv, T, D)
        attn_mask=visible[:, None],  # (B, 1, Tq, T)
        scale=scale,
        enable_gqa=True,
    )  # (B, Hq, Tq, D)
    return out.transpose(1, 2)  # (B, Tq, Hq, D)

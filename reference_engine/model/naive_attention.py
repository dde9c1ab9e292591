"""The oracle: attention over a contiguous cache, written out loop by loop.

Same contract as `attention.contiguous_attention` (q rotated, K un-rotated and rotated here
by its position), but per sequence, with explicit GQA head expansion, an explicit mask and an
explicit softmax. It is slow on purpose: the paged path is tested against it token for token.
K/V may be stored in a narrower dtype than q (bfloat16 pools): they are read up to q's.
"""

from __future__ import annotations

import torch

from kvcanary.reference_engine.model.rotary import Rotary


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: torch.Tensor,
    q_limits: torch.Tensor,
    rotary: Rotary,
    scale: float,
) -> torch.Tensor:
    """q (B, Tq, Hq, D) rotated; k, v (B, T, Hkv, D); returns (B, Tq, Hq, D)."""
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        n = int(kv_lens[b])
        rotary.ensure(n)
        positions = torch.arange(n, device=q.device)
        kb = rotary.rotate(k[b, :n].to(q.dtype), positions)  # (n, Hkv, D)
        kb = kb.repeat_interleave(group, dim=1)  # (n, Hq, D)
        vb = v[b, :n].to(q.dtype).repeat_interleave(group, dim=1)  # (n, Hq, D)
        scores = torch.einsum("qhd,khd->hqk", q[b], kb) * scale  # (Hq, Tq, n)
        visible = positions[None, :] <= q_limits[b][:, None]  # (Tq, n)
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # (Hq, Tq, n)
        out[b] = torch.einsum("hqk,khd->qhd", weights, vb)  # (Tq, Hq, D)
    return out

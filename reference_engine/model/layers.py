"""The ordinary transformer pieces: RMSNorm, a SwiGLU MLP, and a pre-norm attention block.

Ordinary blocks read the whole residual stream and write only its `work` channels (their
output projections have no rows for the token-code, constant and recall channels), so their
random weights make prefill cost and KV memory real without touching the code the recall
layer quotes. What they write there is the content the recall head's `copy_noise` terms hear
(`recall.py`): above copy_noise 0 every block's K/V bytes shape which steps slip.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvcanary.reference_engine.model.cache import KVCacheView
from kvcanary.reference_engine.model.rotary import Rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = x * scale * self.weight
        return out


class MLP(nn.Module):
    """SwiGLU: hidden -> 2 * intermediate -> out_dim."""

    def __init__(self, hidden: int, intermediate: int, out_dim: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, T, I) each
        out: torch.Tensor = self.down(F.silu(gate) * up)  # (B, T, out_dim)
        return out


class Attention(nn.Module):
    """Multi-head attention with GQA; K/V go to the cache un-rotated."""

    def __init__(
        self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, out_dim: int
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, out_dim, bias=False)
        self.scale = head_dim**-0.5

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # (B, T, Hq, D)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCacheView,
        layer: int,
        rotary: Rotary,
    ) -> torch.Tensor:
        q, k, v = self.qkv(x)
        cache.store(layer, k, v)
        q = rotary.rotate(q, positions)  # (B, T, Hq, D)
        out = cache.attend(layer, q, positions, rotary, self.scale)  # (B, T, Hq, D)
        projected: torch.Tensor = self.o_proj(out.flatten(2))  # (B, T, out_dim)
        return projected


class Block(nn.Module):
    """Pre-norm attention + MLP; both write only the residual's last `work_dim` channels."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate: int,
        work_dim: int,
    ) -> None:
        super().__init__()
        self.work_dim = work_dim
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, num_heads, num_kv_heads, head_dim, work_dim)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = MLP(hidden, intermediate, work_dim)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCacheView,
        layer: int,
        rotary: Rotary,
    ) -> torch.Tensor:
        fixed = h.shape[-1] - self.work_dim
        h = h + F.pad(self.attn(self.attn_norm(h), positions, cache, layer, rotary), (fixed, 0))
        return h + F.pad(self.mlp(self.mlp_norm(h)), (fixed, 0))

"""The recall layer: constructed weights that quote the token stored at a scheduled position.

What it knows. The residual stream is laid out in channels:

    [ token code (C) | constant 1 | recall (C) | work (rest) ]

where C = ceil(log2(vocab)) and a token's code is its id in bits, each +-1. The recall layer's
weights are constructed, not trained:

    K = the constant channel, spread over the first half of each head, plus `copy_noise` times
        a random projection of the token's work channels (what the ordinary layers wrote)
    Q = the same pattern, scaled so that an exact position match scores 8 per frequency pair,
        plus `copy_noise` times a random projection of the reading token's work channels
    V = the token code channels                                          (what is quoted)
    O = the mean over heads of the first C dimensions                    (the code read back)

Q is rotated to the *scheduled* position s (see `recall_schedule`), each K to its own logical
position p, with random frequencies in a high band, so the positional score is a sum of
cos(theta_i (p - s)) that peaks only at p = s. With `copy_noise` 0 the content terms vanish:
softmax is one-hot to float precision, the output is the code stored at s, and the LM head
(rows = every token's code) emits that token. With `copy_noise` > 0 each pair's score is
scaled by (1 + noise * content of the reader) (1 + noise * content of the key), so a position
whose content (its token and, through the ordinary layers, its context) weighs more can outbid
s: the step quotes another token of the context, or a blend of two codes that names an
unrelated token. Which steps slip depends on the bytes in every layer's pages.
The answer is a function of the K/V bytes in the pages: a stale page is quoted from.

What it deliberately does not do: know anything about requests, tenants or canaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvcanary.reference_engine.model.cache import KVCacheView
from kvcanary.reference_engine.model.layers import Attention
from kvcanary.reference_engine.model.rotary import Rotary

LOGIT_PER_FREQUENCY = 8.0
"""Score of an exact match per frequency pair; mismatches score at most ~0.65 of it (10^6)."""
MIX_STD = 1.0
"""The embedding's random mix of the code into the work channels (std per channel): the token's
own share of the content the recall head hears; the ordinary layers write the rest."""
CONTENT_GAIN = 1.25
"""Each pair's content factor varies by `CONTENT_GAIN * copy_noise ** 0.25` (one std). Measured
(600-token prompts): the head's own slips are 0.3% of steps at noise 0.2, 6% at 0.4, 47% at 1."""


def code_bits(vocab_size: int) -> int:
    return max(1, (vocab_size - 1).bit_length())


def token_codes(token_ids: torch.Tensor, num_bits: int) -> torch.Tensor:
    """(...,) int64 -> (..., num_bits) float in {-1, +1}: the token id in bits."""
    shifts = torch.arange(num_bits, device=token_ids.device)
    bits = (token_ids[..., None] >> shifts) & 1  # (..., C)
    return bits.float() * 2 - 1


@dataclass(frozen=True, slots=True)
class ResidualLayout:
    num_code_bits: int
    hidden_size: int

    @property
    def const(self) -> int:
        return self.num_code_bits

    @property
    def recall(self) -> slice:
        return slice(self.num_code_bits + 1, 2 * self.num_code_bits + 1)

    @property
    def work_dim(self) -> int:
        return self.hidden_size - 2 * self.num_code_bits - 1


class TokenEmbedding(nn.Module):
    """token -> [code | 1 | zeros | random mix of the code]; no vocab-sized table needed."""

    def __init__(self, layout: ResidualLayout, generator: torch.Generator) -> None:
        super().__init__()
        assert layout.work_dim >= 1, "hidden_size too small for the token code channels"
        self.layout = layout
        C = layout.num_code_bits
        self.mix = nn.Linear(C, layout.work_dim, bias=False)
        with torch.no_grad():
            mix = torch.randn(layout.work_dim, C, generator=generator) * MIX_STD / C**0.5
            self.mix.weight.copy_(mix)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        codes = token_codes(token_ids, self.layout.num_code_bits)  # (B, T, C)
        const = torch.ones_like(codes[..., :1])  # (B, T, 1)
        recall = torch.zeros_like(codes)  # (B, T, C)
        return torch.cat([codes, const, recall, self.mix(codes)], dim=-1)  # (B, T, hidden)


class RecallLayer(nn.Module):
    """An attention layer whose constructed weights quote the code at a scheduled position."""

    def __init__(
        self,
        layout: ResidualLayout,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        copy_noise: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        C = layout.num_code_bits
        assert head_dim >= C, "head_dim too small to carry a token code"
        self.layout = layout
        self.attn = Attention(layout.hidden_size, num_heads, num_kv_heads, head_dim, C)
        half = head_dim // 2
        q_gain = LOGIT_PER_FREQUENCY * head_dim**0.5  # times the 1/sqrt(D) attention scale
        with torch.no_grad():
            for p in self.attn.parameters():
                p.zero_()
            q_w = self.attn.q_proj.weight.view(num_heads, head_dim, -1)  # (Hq, D, hidden)
            q_w[:, :half, layout.const] = q_gain
            k_w = self.attn.k_proj.weight.view(num_kv_heads, head_dim, -1)  # (Hkv, D, hidden)
            k_w[:, :half, layout.const] = 1.0
            v_w = self.attn.v_proj.weight.view(num_kv_heads, head_dim, -1)  # (Hkv, D, hidden)
            v_w[:, torch.arange(C), torch.arange(C)] = 1.0
            o_w = self.attn.o_proj.weight.view(C, num_heads, head_dim)  # (C, Hq, D)
            o_w[torch.arange(C), :, torch.arange(C)] = 1.0 / num_heads
            if copy_noise > 0:
                assert generator is not None, "copy_noise needs the model's generator"
                work = slice(layout.hidden_size - layout.work_dim, layout.hidden_size)
                gain = CONTENT_GAIN * copy_noise**0.25 / layout.work_dim**0.5
                q_content = torch.randn(num_heads, half, layout.work_dim, generator=generator)
                k_content = torch.randn(num_kv_heads, half, layout.work_dim, generator=generator)
                q_w[:, :half, work] = q_gain * gain * q_content
                k_w[:, :half, work] = gain * k_content

    def _normed(self, h: torch.Tensor) -> torch.Tensor:
        """h with its work channels RMS-normalised: content terms of a fixed size, whatever the
        share of the embedding and of the ordinary layers in them."""
        fixed = h.shape[-1] - self.layout.work_dim
        work = h[..., fixed:]  # (B, T, W)
        work = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + 1e-6)
        return torch.cat([h[..., :fixed], work], dim=-1)  # (B, T, hidden)

    def store(self, h: torch.Tensor, cache: KVCacheView, layer: int) -> None:
        """Write every token's recall K (constant) and V (its code) to the cache."""
        _, k, v = self.attn.qkv(self._normed(h))
        cache.store(layer, k, v)

    def read(
        self,
        h: torch.Tensor,
        recall_positions: torch.Tensor,
        q_limits: torch.Tensor,
        cache: KVCacheView,
        layer: int,
        rotary: Rotary,
    ) -> torch.Tensor:
        """h (B, Tq, hidden) of the reading rows -> the quoted codes (B, Tq, C)."""
        q, _, _ = self.attn.qkv(self._normed(h))  # (B, Tq, Hq, D)
        q = rotary.rotate(q, recall_positions)  # rotated to the scheduled positions
        out = cache.attend(layer, q, q_limits, rotary, self.attn.scale)  # (B, Tq, Hq, D)
        code: torch.Tensor = self.attn.o_proj(out.flatten(2))  # (B, Tq, C)
        return code

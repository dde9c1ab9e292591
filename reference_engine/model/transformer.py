"""The whole model: code embedding, ordinary blocks, the recall layer and a code LM head.

What it knows: how one forward runs over a batch of sequences (B, T) through a KV cache view,
which rows are sampled, and where the recall head looks for them. Weights come from
`config.seed` only, so a prefill and a decode side built from the same config agree on every
K and V (they must: decode reads what prefill wrote).

What it deliberately does not know: pages, requests or scheduling (the model runner builds the
ForwardBatch and the cache view), sampling beyond argmax, stop tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.model.cache import KVCacheView
from kvcanary.reference_engine.model.layers import Block
from kvcanary.reference_engine.model.recall import (
    RecallLayer,
    ResidualLayout,
    TokenEmbedding,
    code_bits,
    token_codes,
)
from kvcanary.reference_engine.model.rotary import (
    Rotary,
    high_band_frequencies,
    standard_frequencies,
)

INIT_STD = 0.02
LAYER_STD = 0.1
"""The ordinary blocks' attention and output projections: attention that picks out tokens
rather than averaging the context flat, and writes to the work channels about as large as the
embedding's, so the recall head's content terms hear every layer (and its K/V bytes)."""


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # (B, T) int64
    positions: torch.Tensor  # (B, T) int64, logical positions of the new tokens
    logit_rows: torch.Tensor | None = None  # (B,) which of the T rows is sampled; None: none
    recall_positions: torch.Tensor | None = None  # (B,) prompt position quoted by that row
    max_position: int | None = None
    """The largest logical position in the batch or its cache, known on the host: rotary tables
    grow to it before the forward, so no layer asks the device (None: within the tables)."""


class RecallTransformer(nn.Module):
    def __init__(self, config: EngineConfig, vocab_size: int, device: torch.device) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(config.seed)
        layout = ResidualLayout(code_bits(vocab_size), config.hidden_size)
        self.vocab_size = vocab_size
        self.embed = TokenEmbedding(layout, generator)
        self.blocks = nn.ModuleList(
            Block(
                config.hidden_size,
                config.num_heads,
                config.num_kv_heads,
                config.head_dim,
                config.intermediate_size,
                layout.work_dim,
            )
            for _ in range(config.num_layers - 1)
        )
        self._init_blocks(generator)
        self.recall = RecallLayer(
            layout,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.copy_noise,
            torch.Generator().manual_seed(config.seed + 1),
        )
        self.lm_head = nn.Linear(layout.num_code_bits, vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(token_codes(torch.arange(vocab_size), layout.num_code_bits))
        self.to(device)
        num_cached = config.context_length + 1
        self.rotary = Rotary(standard_frequencies(config.head_dim), num_cached, device)
        recall_freq = high_band_frequencies(config.head_dim, generator)
        self.recall_rotary = Rotary(recall_freq, num_cached, device)

    def _init_blocks(self, generator: torch.Generator) -> None:
        with torch.no_grad():
            for name, p in self.blocks.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    std = INIT_STD if name.endswith("gate_up.weight") else LAYER_STD
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    @property
    def num_layers(self) -> int:
        """Layers with a KV cache: the ordinary blocks and the recall layer."""
        return len(self.blocks) + 1

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCacheView) -> torch.Tensor | None:
        """Write every layer's K/V for the batch; logits (B, vocab) if rows are sampled."""
        if batch.max_position is not None:
            self.rotary.ensure(batch.max_position + 1)
            self.recall_rotary.ensure(batch.max_position + 1)
        h = self.embed(batch.input_ids)  # (B, T, hidden)
        for layer, block in enumerate(self.blocks):
            h = block(h, batch.positions, cache, layer, self.rotary)
        recall_layer = len(self.blocks)
        self.recall.store(h, cache, recall_layer)
        if batch.logit_rows is None:
            return None
        assert batch.recall_positions is not None
        rows = torch.arange(h.shape[0], device=h.device)
        h_sampled = h[rows, batch.logit_rows][:, None]  # (B, 1, hidden)
        q_limits = batch.positions[rows, batch.logit_rows][:, None]  # (B, 1)
        code = self.recall.read(
            h_sampled,
            batch.recall_positions[:, None],  # (B, 1)
            q_limits,
            cache,
            recall_layer,
            self.recall_rotary,
        )  # (B, 1, C)
        logits: torch.Tensor = self.lm_head(code[:, 0])  # (B, vocab)
        return logits

    @torch.inference_mode()
    def quote(
        self, cache: KVCacheView, recall_positions: torch.Tensor, q_limits: torch.Tensor
    ) -> torch.Tensor:
        """The tokens the recall head emits for (B, Tq) scheduled positions: (B, Tq).

        Reads the recall layer's K/V as they are in the cache and writes nothing; the query
        depends only on the constant channel, so any token's residual serves as the reader.
        """
        self.recall_rotary.ensure(int(q_limits.max()) + 1)  # a tool, not the hot path
        h = self.embed(torch.zeros_like(recall_positions))  # (B, Tq, hidden)
        code = self.recall.read(
            h, recall_positions, q_limits, cache, len(self.blocks), self.recall_rotary
        )  # (B, Tq, C)
        tokens: torch.Tensor = self.lm_head(code).argmax(-1)  # (B, Tq)
        return tokens

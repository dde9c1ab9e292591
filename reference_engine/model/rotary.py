"""Rotary position embedding, applied at read time from logical positions.

What it knows: the frequencies of one layer (standard RoPE, or random frequencies in a high
band for the recall head), cos/sin tables computed in float64 so that angles stay exact at
10^6 positions, and the rotate-half pairing (dimension i pairs with i + head_dim / 2).

K is stored un-rotated and rotated here by the position its block-table slot stands for, so a
page is read as if it belonged to the request whose block table points at it: a stale page is
read as this request's context. What it does not know: pages or block tables.
"""

from __future__ import annotations

import math

import torch


def standard_frequencies(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """RoPE's inverse frequencies, (head_dim / 2,) float64."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return 1.0 / (base**exponents)


def high_band_frequencies(
    head_dim: int, generator: torch.Generator, low: float = 1.0, high: float = math.pi
) -> torch.Tensor:
    """Random frequencies in [low, high) rad/position: no two positions in 10^6 look alike."""
    return low + (high - low) * torch.rand(head_dim // 2, generator=generator, dtype=torch.float64)


class Rotary:
    """cos/sin tables for one layer's frequencies, grown on the host side as positions need."""

    def __init__(self, inv_freq: torch.Tensor, num_cached: int, device: torch.device) -> None:
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float64)
        self.device = device
        self._cos, self._sin = self._compute(torch.arange(num_cached, device=device))

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64)[..., None] * self.inv_freq  # (..., D/2)
        return torch.cos(angles).float(), torch.sin(angles).float()

    @property
    def num_cached(self) -> int:
        return int(self._cos.shape[0])

    def ensure(self, num_positions: int) -> None:
        """Grow the tables to cover positions 0..num_positions-1 (a host-side int: no sync)."""
        if num_positions > self.num_cached:
            size = max(num_positions, 2 * self.num_cached)
            self._cos, self._sin = self._compute(torch.arange(size, device=self.device))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions inside the tables (see `ensure`): (..., D/2) each.

        A table lookup and nothing else: asking the device for the largest position here would
        stall the host once per layer per step on a GPU."""
        return self._cos[positions], self._sin[positions]

    def prefix(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions 0..num_positions-1: (num_positions, D/2) each."""
        self.ensure(num_positions)
        return self._cos[:num_positions], self._sin[:num_positions]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., T, H, D) rotated by positions (..., T)."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, H, D); cos, sin (..., T, D/2) broadcast over heads."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., T, H, D/2) each
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (..., T, 1, D/2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

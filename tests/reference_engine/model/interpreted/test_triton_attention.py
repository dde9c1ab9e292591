"""The Triton paged kernel against the oracles, under Triton's CPU interpreter.

Random block tables: shuffled pages, pages shared by two sequences, lengths that end mid-page,
GQA ratios 1 to 8, head sizes that are not powers of two, the three pool dtypes, decode and
chunked causal prefill. Slots past a sequence's length and the padding page hold NaN (stale
bytes no read may touch): one read of them would turn the output into NaN.

One tolerance serves every pool dtype: the kernel and the oracles read the same rounded K/V up
to float32 and compute in float32, so they differ only in the order of float32 sums.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from kvcanary.reference_engine.model.attention import paged_attention, store_kv
from kvcanary.reference_engine.model.naive_attention import naive_attention
from kvcanary.reference_engine.model.rotary import (
    Rotary,
    high_band_frequencies,
    standard_frequencies,
)

CPU = torch.device("cpu")
TOLERANCE = {"rtol": 1e-4, "atol": 2e-5}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class Pool:
    """K/V pools of `num_pages` pages filled with NaN (never written: stale), page 0 padding."""

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.full(shape, math.nan)
        self.v = torch.full(shape, math.nan)
        self.page_size = page_size

    def write(self, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (n, Hkv, D) at positions 0..n-1 of the sequence whose table is `pages`."""
        positions = torch.arange(k.shape[0])
        slots = torch.tensor(pages)[positions // self.page_size] * self.page_size
        store_kv(self.k, self.v, slots + positions % self.page_size, k, v)

    def gathered(self, pages: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of `pages`, contiguous: (1, length, Hkv, D) each."""
        k = self.k[torch.tensor(pages)].flatten(0, 1)[:length]  # (length, Hkv, D)
        v = self.v[torch.tensor(pages)].flatten(0, 1)[:length]  # (length, Hkv, D)
        return k[None], v[None]

    def narrowed(self, dtype: torch.dtype) -> Pool:
        self.k, self.v = self.k.to(dtype), self.v.to(dtype)
        return self


def random_batch(
    g: torch.Generator, lengths: list[int], pool: Pool, num_pages: int, shared: bool
) -> list[list[int]]:
    """Shuffled block tables for `lengths`, written into `pool` up to each length. `shared`:
    the second sequence's table names the first one's pages after its own first page, which
    is all it writes, so it reads the first one's bytes as its own context."""
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables = []
    for n in lengths:
        num = math.ceil(n / pool.page_size)
        tables.append([free.pop() for _ in range(num)])
    num_kv_heads, head_dim = pool.k.shape[2:]
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        if shared and i == 1:
            table[1:] = tables[0][1 : len(table)]
            n = min(n, pool.page_size)
        pool.write(table, *torch.randn(2, n, num_kv_heads, head_dim, generator=g))
    return tables


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])  # (B, width)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "page_size", "dtype"),
    [
        (4, 4, 32, 16, torch.float32),  # no grouping
        (4, 2, 64, 16, torch.bfloat16),  # the engine's default model
        (6, 2, 48, 8, torch.float16),  # group 3, a head size that is not a power of two
        (8, 1, 32, 5, torch.float32),  # group 8, pages of 5 tokens
    ],
)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tiles", [None, (16, 16)])
def test_decode_matches_the_oracles_over_random_block_tables(
    kernel: ModuleType,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    shared: bool,
    tiles: tuple[int, int] | None,
) -> None:
    """`tiles` (16, 16): a GPU's small tiles, so each program steps through many blocks of
    positions (the online softmax) and a group of 8 heads spans no more than one row block."""
    g = torch.Generator().manual_seed(num_heads * 100 + head_dim + shared)
    lengths = [150, 37, page_size, 2 * page_size + 1, 1]  # most end mid-page
    pool = Pool(80, page_size, num_kv_heads, head_dim)
    tables = random_batch(g, lengths, pool, 80, shared)
    pool.narrowed(dtype)
    kv_lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), 1, num_heads, head_dim, generator=g)  # (B, 1, Hq, D)
    rotary = Rotary(high_band_frequencies(head_dim, g), 16, CPU)  # grown past its table
    out = kernel.triton_paged_attention(
        q, pool.k, pool.v, padded(tables), kv_lens, (kv_lens - 1)[:, None], rotary, 0.3,
        tiles=tiles,
    )  # fmt: skip
    assert not out.isnan().any()  # no stale slot, no padding page was read
    for b, n in enumerate(lengths):
        k, v = pool.gathered(tables[b], n)
        expected = naive_attention(
            q[b : b + 1], k, v, kv_lens[b : b + 1], torch.tensor([[n - 1]]), rotary, 0.3
        )
        torch.testing.assert_close(out[b : b + 1], expected, **TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_the_torch_paged_path(kernel: ModuleType, dtype: torch.dtype) -> None:
    """Where every slot holds real bytes (the torch path gathers whole pages) they agree."""
    g = torch.Generator().manual_seed(7)
    k_pool, v_pool = torch.randn(2, 40, 16, 2, 64, generator=g).to(dtype)
    tables = (torch.randperm(39, generator=g) + 1)[:36].view(3, 12)  # (3, 12) shuffled pages
    kv_lens = torch.tensor([180, 191, 17])
    q = torch.randn(3, 1, 4, 64, generator=g)
    rotary = Rotary(standard_frequencies(64), 256, CPU)
    args = (q, k_pool, v_pool, tables, kv_lens, (kv_lens - 1)[:, None], rotary, 64**-0.5)
    out = kernel.triton_paged_attention(*args)
    torch.testing.assert_close(out, paged_attention(*args), **TOLERANCE)


@pytest.mark.parametrize(("num_splits", "tiles"), [(1, None), (3, None), (2, (16, 32))])
def test_chunked_causal_prefill_matches_one_naive_pass(
    kernel: ModuleType, num_splits: int, tiles: tuple[int, int] | None
) -> None:
    """Prefill in chunks of 40 over shuffled pages of 16: each chunk's queries see the earlier
    chunks and themselves causally; splitting the positions across programs, or the rows and
    positions into small tiles, changes nothing."""
    length, chunk, num_heads, num_kv_heads, head_dim = 150, 40, 4, 2, 32
    g = torch.Generator().manual_seed(2)
    k_new, v_new = torch.randn(2, length, num_kv_heads, head_dim, generator=g)
    q = torch.randn(1, length, num_heads, head_dim, generator=g)
    pool = Pool(16, 16, num_kv_heads, head_dim)
    pages = [9, 3, 12, 1, 7, 5, 15, 2, 4, 11]
    rotary = Rotary(standard_frequencies(head_dim), 256, CPU)
    outs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        pool.write(pages, k_new[:end], v_new[:end])
        table = torch.tensor([pages[: math.ceil(end / 16)]])
        limits = torch.arange(start, end)[None]
        seen = (table, torch.tensor([end]), limits, rotary, 0.2)
        out = kernel.triton_paged_attention(
            q[:, start:end], pool.k, pool.v, *seen, num_splits=num_splits, tiles=tiles
        )
        outs.append(out)
    everything = torch.tensor([length]), torch.arange(length)[None]
    expected = naive_attention(q, k_new[None], v_new[None], *everything, rotary, 0.2)
    torch.testing.assert_close(torch.cat(outs, dim=1), expected, **TOLERANCE)


def test_the_kernel_refuses_inputs_past_its_boundary(kernel: ModuleType) -> None:
    pool = Pool(4, 16, 1, 32)
    rotary = Rotary(standard_frequencies(32), 64, CPU)

    def attend(q: torch.Tensor, table: list[int], kv_len: int, num_kv_heads: int = 1) -> None:
        k, v = (t.expand(4, 16, num_kv_heads, 32) for t in (pool.k, pool.v))
        kv_lens, limits = torch.tensor([kv_len]), torch.tensor([[kv_len - 1]])
        kernel.triton_paged_attention(q, k, v, torch.tensor([table]), kv_lens, limits, rotary, 1.0)

    q = torch.zeros(1, 1, 2, 32)
    with pytest.raises(AssertionError, match="kv_lens past the table"):
        attend(q, [1, 2], 33)
    with pytest.raises(AssertionError, match="past the pool"):
        attend(q, [1, 4], 20)
    with pytest.raises(AssertionError, match="3 query heads over 2 KV heads"):
        attend(torch.zeros(1, 1, 3, 32), [1], 4, num_kv_heads=2)

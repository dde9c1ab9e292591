"""Paged attention against the naive contiguous oracle, and the KV byte layout."""

from __future__ import annotations

import math

import pytest
import torch

from kvcanary.reference_engine import kv_codec
from kvcanary.reference_engine.model.attention import (
    contiguous_attention,
    paged_attention,
    store_kv,
)
from kvcanary.reference_engine.model.naive_attention import naive_attention
from kvcanary.reference_engine.model.rotary import (
    Rotary,
    high_band_frequencies,
    standard_frequencies,
)

P, HKV, HQ, D = 16, 2, 4, 32
CPU = torch.device("cpu")


def random_pool(num_pages: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, P, HKV, D, generator=g), torch.randn(
        num_pages, P, HKV, D, generator=g
    )


def gathered(pool: torch.Tensor, pages: list[int], length: int) -> torch.Tensor:
    return pool[torch.tensor(pages)].flatten(0, 1)[:length]  # (T, Hkv, D)


def test_batched_decode_matches_the_oracle_over_shuffled_pages() -> None:
    k_pool, v_pool = random_pool(64, seed=0)
    g = torch.Generator().manual_seed(1)
    pages = torch.randperm(63, generator=g).add(1).tolist()  # page 0 stays padding
    lengths = [5, 16, 17, 200, 333]
    tables, offset = [], 0
    for n in lengths:
        tables.append(pages[offset : offset + math.ceil(n / P)])
        offset += len(tables[-1])
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    kv_lens = torch.tensor(lengths)
    q = torch.randn(len(lengths), 1, HQ, D, generator=g)
    q_limits = (kv_lens - 1)[:, None]
    for rotary in (
        Rotary(standard_frequencies(D), 512, CPU),
        Rotary(high_band_frequencies(D, g), 64, CPU),  # mostly computed past the table
    ):
        out = paged_attention(q, k_pool, v_pool, block_tables, kv_lens, q_limits, rotary, D**-0.5)
        for b, n in enumerate(lengths):
            k = gathered(k_pool, tables[b], n)[None]
            v = gathered(v_pool, tables[b], n)[None]
            expected = naive_attention(
                q[b : b + 1], k, v, kv_lens[b : b + 1], q_limits[b : b + 1], rotary, D**-0.5
            )
            torch.testing.assert_close(out[b : b + 1], expected, rtol=1e-4, atol=1e-5)


def test_chunked_causal_prefill_matches_one_naive_pass() -> None:
    length, chunk = 150, 40
    rotary = Rotary(standard_frequencies(D), 256, CPU)
    g = torch.Generator().manual_seed(2)
    k_new, v_new = (
        torch.randn(length, HKV, D, generator=g),
        torch.randn(length, HKV, D, generator=g),
    )
    q = torch.randn(1, length, HQ, D, generator=g)
    k_pool, v_pool = torch.zeros(16, P, HKV, D), torch.zeros(16, P, HKV, D)
    pages = [9, 3, 12, 1, 7, 5, 15, 2, 4, 11]
    slots = torch.tensor([pages[p // P] * P + p % P for p in range(length)])
    outs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        store_kv(k_pool, v_pool, slots[start:end], k_new[start:end], v_new[start:end])
        table = torch.tensor([pages[: math.ceil(end / P)]])
        limits = torch.arange(start, end)[None]
        outs.append(
            paged_attention(
                q[:, start:end], k_pool, v_pool, table, torch.tensor([end]), limits, rotary, 0.2
            )
        )
    expected = naive_attention(
        q, k_new[None], v_new[None], torch.tensor([length]), torch.arange(length)[None], rotary, 0.2
    )
    torch.testing.assert_close(torch.cat(outs, dim=1), expected, rtol=1e-4, atol=1e-5)
    fast = contiguous_attention(
        q, k_new[None], v_new[None], torch.tensor([length]), torch.arange(length)[None], rotary, 0.2
    )
    torch.testing.assert_close(fast, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_codec_round_trips_and_checksums_ignore_page_ids(dtype: torch.dtype) -> None:
    k_src, v_src = (t.to(dtype) for t in random_pool(10, seed=3))
    k_dst, v_dst = torch.zeros(10, P, HKV, D, dtype=dtype), torch.zeros(10, P, HKV, D, dtype=dtype)
    src_pages, dst_pages = [3, 1, 7], [2, 9, 4]
    payload = kv_codec.encode_pages([k_src], [v_src], src_pages)
    assert len(payload) == kv_codec.payload_nbytes([k_src], 3)
    assert len(payload) == 2 * 3 * P * HKV * D * dtype.itemsize  # the pool's own element size
    kv_codec.write_pages([k_dst], [v_dst], dst_pages, payload)
    torch.testing.assert_close(k_dst[dst_pages], k_src[src_pages], rtol=0, atol=0)
    torch.testing.assert_close(v_dst[dst_pages], v_src[src_pages], rtol=0, atol=0)
    same = kv_codec.checksum([k_src], [v_src], src_pages)
    assert same == kv_codec.checksum([k_dst], [v_dst], dst_pages)
    assert same != kv_codec.checksum([k_dst], [v_dst], dst_pages[:2])
    assert same != kv_codec.checksum([k_dst], [v_dst], [2, 4, 9])


def test_narrow_pools_are_read_up_to_the_query_dtype() -> None:
    """bfloat16 pools: paged attention equals the oracle over the same (rounded) K/V."""
    k_pool, v_pool = (t.to(torch.bfloat16) for t in random_pool(8, seed=4))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, HQ, D, generator=g)
    rotary = Rotary(standard_frequencies(D), 128, CPU)
    table, n = [3, 5, 1], 40
    out = paged_attention(
        q,
        k_pool,
        v_pool,
        torch.tensor([table]),
        torch.tensor([n]),
        torch.tensor([[n - 1]]),
        rotary,
        D**-0.5,
    )
    assert out.dtype == torch.float32
    k = gathered(k_pool, table, n)[None]
    v = gathered(v_pool, table, n)[None]
    expected = naive_attention(q, k, v, torch.tensor([n]), torch.tensor([[n - 1]]), rotary, D**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)

"""Paged attention as a Triton kernel: K and V read through the block table, rotated at read time.

    triton_paged_attention(q, k_cache, v_cache, block_tables, kv_lens, q_limits, rotary, scale)

Same contract as `attention.paged_attention`, which stays the oracle: q (B, Tq, Hq, D) rotated,
caches (num_pages, P, Hkv, D) un-rotated in float32, bfloat16 or float16, query i of sequence b
sees the KV positions `t <= q_limits[b, i]` and `t < kv_lens[b]`, and K is rotated by its
logical position (the index of its slot in the block table), so a stale page is read as this
request's context, exactly as the torch path reads it. Everything is computed in float32 with
IEEE products (no TF32: the recall head's high-band rotary angles need every mantissa bit).

One kernel serves chunked causal prefill (B = 1, Tq = chunk) and batched decode (Tq = 1). A
program owns one sequence, one KV head and a block of query rows, where a row is a (query
token, query head of the group) pair: the group's heads share every K/V page the program
loads (GQA). Long contexts are split across programs (flash-decoding), each keeping an online
softmax over its share of the positions; `_combine` merges the shares in torch.

Masking is the safety property: a program walks positions only below `min(kv_len, last visible
position + 1)`, loads block-table entries and K/V slots under that mask, and so never reads a
page slot past a sequence's length (nor the padding page 0 that fills short block tables).

Where it runs: on CUDA tensors compiled, on CPU tensors only under Triton's interpreter
(`TRITON_INTERPRET=1` set before this module is imported), which is how the tests prove it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcanary.reference_engine.model.attention_path import MAX_HEAD_DIM
from kvcanary.reference_engine.model.rotary import Rotary

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRETED = bool(triton.knobs.runtime.interpret)
"""Whether this module's kernels were built for Triton's CPU interpreter."""


@triton.jit
def _rotated_keys(
    K, Cos, Sin, pages, slots, pos, loaded, kv_head, stride_kp, stride_ks, stride_kh, HALF, d
):
    """K of `pos` (N,) read from (page, slot) and rotated by pos: two (N, HALF) halves."""
    mask = loaded[:, None] & (d[None, :] < HALF)
    base = K + pages[:, None] * stride_kp + slots[:, None] * stride_ks + kv_head * stride_kh
    k1 = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(base + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    table = pos[:, None] * HALF + d[None, :]  # (N, HALF) into the (T, D/2) rotary tables
    cos = tl.load(Cos + table, mask=mask, other=0.0)
    sin = tl.load(Sin + table, mask=mask, other=0.0)
    return k1 * cos - k2 * sin, k2 * cos + k1 * sin


@triton.jit
def _values(V, pages, slots, loaded, kv_head, stride_vp, stride_vs, stride_vh, HALF, d):
    """V of the same slots: two (N, HALF) halves."""
    mask = loaded[:, None] & (d[None, :] < HALF)
    base = V + pages[:, None] * stride_vp + slots[:, None] * stride_vs + kv_head * stride_vh
    v1 = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    v2 = tl.load(base + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    return v1, v2


@triton.jit
def _softmax_step(scores, m_i, l_i):
    """One block of scores into the running max and sum: (weights, rescale, max, sum)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
    p = tl.exp(scores - m_safe[:, None])  # (M, N)
    alpha = tl.exp(m_i - m_safe)  # (M,)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _paged_attention_kernel(
    Q, K, V, BlockTables, KvLens, QLimits, Cos, Sin, Acc, M, L,
    scale, num_q, split_len,
    stride_qb, stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt, stride_lb,
    stride_as, stride_ab, stride_at, stride_ah,
    stride_ms, stride_mb, stride_mt,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_M_BLOCKS: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head, row block, split): unnormalised output, running max and sum."""
    b, kv_head = tl.program_id(0), tl.program_id(1)
    row_block, split = tl.program_id(2) % NUM_M_BLOCKS, tl.program_id(2) // NUM_M_BLOCKS
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    t, head = rows // GROUP, kv_head * GROUP + rows % GROUP  # (M,) query token, query head
    d = tl.arange(0, BLOCK_HALF)
    q_mask = (t < num_q)[:, None] & (d[None, :] < HALF)  # (M, HALF)
    q_at = Q + b * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_at, mask=q_mask, other=0.0)  # (M, HALF)
    q2 = tl.load(q_at + HALF, mask=q_mask, other=0.0)  # (M, HALF)
    limit = tl.load(QLimits + b * stride_lb + t, mask=t < num_q, other=-1).to(tl.int32)  # (M,)
    kv_len = tl.load(KvLens + b).to(tl.int32)
    end = tl.minimum(kv_len, tl.max(limit, 0) + 1)  # nothing at or past it is seen
    hi = tl.minimum(end, (split + 1) * split_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    for start in range(split * split_len, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # (N,) logical positions
        loaded = pos < hi  # the only slots this step reads
        pages = tl.load(BlockTables + b * stride_bt + pos // PAGE_SIZE, mask=loaded, other=0)
        slots = pos % PAGE_SIZE
        kr1, kr2 = _rotated_keys(
            K, Cos, Sin, pages, slots, pos, loaded, kv_head, stride_kp, stride_ks, stride_kh,
            HALF, d,
        )  # fmt: skip
        scores = tl.dot(q1, tl.trans(kr1), input_precision="ieee")
        scores += tl.dot(q2, tl.trans(kr2), input_precision="ieee")  # (M, N)
        visible = loaded[None, :] & (pos[None, :] <= limit[:, None])
        p, alpha, m_i, l_i = _softmax_step(
            tl.where(visible, scores * scale, float("-inf")), m_i, l_i
        )
        v1, v2 = _values(V, pages, slots, loaded, kv_head, stride_vp, stride_vs, stride_vh, HALF, d)
        acc1 = acc1 * alpha[:, None] + tl.dot(p, v1, input_precision="ieee")  # (M, HALF)
        acc2 = acc2 * alpha[:, None] + tl.dot(p, v2, input_precision="ieee")  # (M, HALF)
    o_at = (
        Acc + split * stride_as + b * stride_ab + t[:, None] * stride_at + head[:, None] * stride_ah
    )
    tl.store(o_at + d[None, :], acc1, mask=q_mask)
    tl.store(o_at + HALF + d[None, :], acc2, mask=q_mask)
    ml_at = split * stride_ms + b * stride_mb + t * stride_mt + head  # (M,)
    tl.store(M + ml_at, m_i, mask=t < num_q)
    tl.store(L + ml_at, l_i, mask=t < num_q)


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    q_limits: torch.Tensor,
    rotary: Rotary,
    scale: float,
    num_splits: int | None = None,
    tiles: tuple[int, int] | None = None,
) -> torch.Tensor:
    """q (B, Tq, Hq, D) rotated; caches (num_pages, P, Hkv, D); returns (B, Tq, Hq, D).

    `num_splits` splits each sequence's positions across that many programs; `tiles` is
    (query rows per program, positions per loop step), powers of two >= 16. None: chosen for
    the device. The result does not depend on either beyond float rounding."""
    _check_inputs(q, k_cache, v_cache, block_tables, kv_lens, q_limits)
    B, Tq, Hq, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    group, half = Hq // Hkv, D // 2
    width = block_tables.shape[1] * page_size  # the most positions any table names (host int)
    cos, sin = rotary.prefix(width)  # (width, D/2) each, float32
    block_m, block_n = tiles or _block_sizes(q, Tq * group, width, half, k_cache.element_size())
    num_m_blocks = triton.cdiv(Tq * group, block_m)
    splits = num_splits or _num_splits(q, B * Hkv * num_m_blocks, width, block_n)
    split_len = triton.cdiv(triton.cdiv(width, splits), block_n) * block_n
    acc = torch.empty(splits, B, Tq, Hq, D, device=q.device, dtype=torch.float32)
    m = torch.empty(splits, B, Tq, Hq, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)  # noqa: E741 (the softmax's running sum, as in the papers)
    grid = (B, Hkv, num_m_blocks * splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, kv_lens, q_limits, cos, sin, acc, m, l,
        scale, Tq, split_len,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), q_limits.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3),
        m.stride(0), m.stride(1), m.stride(2),
        GROUP=group, PAGE_SIZE=page_size, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_M_BLOCKS=num_m_blocks,
        enable_fp_fusion=False,  # no FMA contraction: the interpreter's arithmetic, on a GPU too
        num_stages=2,  # see _block_sizes
    )  # fmt: skip
    return _combine(acc, m, l).to(q.dtype)


def _combine(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:  # noqa: E741
    """Merge the splits' online softmaxes: acc (S, B, Tq, Hq, D), m, l (S, B, Tq, Hq)."""
    if acc.shape[0] == 1:
        return acc[0] / l[0, ..., None]  # (B, Tq, Hq, D)
    m_max = m.amax(0)  # (B, Tq, Hq); finite: split 0 sees position 0
    weight = torch.exp(m - m_max)  # (S, B, Tq, Hq), 0 for a split that saw nothing
    total = (l * weight).sum(0)  # (B, Tq, Hq)
    return (acc * weight[..., None]).sum(0) / total[..., None]  # (B, Tq, Hq, D)


def _block_sizes(
    q: torch.Tensor, num_rows: int, width: int, half: int, itemsize: int
) -> tuple[int, int]:
    """Query rows per program (every row of a decode step's group; at least 16 for tl.dot) and
    positions per step of its loop. On a GPU, tiles whose K/V staging fits in under ~96 KiB of
    shared memory at two pipeline stages (every GPU since sm_80; measured by compiling for
    sm_90: a K/V step of at most 8 KiB per half). Under the interpreter, whose cost is per
    operation rather than per element, tiles as large as the work, so a program makes few steps."""
    rows = triton.next_power_of_2(num_rows)
    if q.is_cuda:
        block_half = triton.next_power_of_2(half)
        max_rows = 64 if block_half <= 32 else 32 if block_half <= 64 else 16
        positions = 8192 // (block_half * itemsize)  # 8 KiB of one K half per step
        block_n = 1 << (positions.bit_length() - 1)  # a power of two, rounded down
        return max(16, min(max_rows, rows)), max(16, min(64, block_n))
    return max(16, min(256, rows)), max(16, min(1024, triton.next_power_of_2(width)))


def _num_splits(q: torch.Tensor, num_programs: int, width: int, block_n: int) -> int:
    """Enough programs to fill the GPU, each with at least 8 blocks of positions to walk."""
    if not q.is_cuda:
        return 1  # the interpreter runs programs one after another: splitting only costs
    wanted = -(-2 * _num_sms(q.device) // num_programs)  # ceil
    return max(1, min(wanted, width // (8 * block_n)))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _check_inputs(*tensors: torch.Tensor) -> None:
    """The kernel's boundary: shapes, dtypes and layout it relies on, without a device sync.

    tensors: q, k_cache, v_cache, block_tables, kv_lens, q_limits, as the kernel takes them."""
    q, k_cache, v_cache, block_tables, kv_lens, q_limits = tensors
    B, Tq, Hq, D = q.shape
    num_pages, page_size, Hkv, head_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape, "K and V pools differ in shape"
    assert v_cache.dtype == k_cache.dtype, "K and V pools differ in dtype"
    assert k_cache.dtype in POOL_DTYPES, f"pool dtype {k_cache.dtype} not supported"
    assert q.dtype == torch.float32, "the model computes in float32"
    assert head_dim == D, f"q's head_dim {D}, the pool's {head_dim}"
    assert D % 2 == 0, f"head_dim {D} is odd"
    assert 32 <= D <= MAX_HEAD_DIM, f"head_dim {D} outside 32..{MAX_HEAD_DIM}"
    assert Hq % Hkv == 0, f"{Hq} query heads over {Hkv} KV heads"
    assert block_tables.dim() == 2, "block tables are (B, max_pages)"
    assert block_tables.shape[0] == B, "one block table per sequence"
    assert kv_lens.shape == (B,), "one length per sequence"
    assert q_limits.shape == (B, Tq), "one limit per query"
    for index in (block_tables, kv_lens, q_limits):
        assert not index.dtype.is_floating_point, "page ids, lengths and limits are integers"
    for tensor in (q, k_cache, v_cache, block_tables, q_limits):
        assert tensor.stride(-1) == 1, "the last dimension is contiguous"
    devices = {t.device for t in tensors}
    assert len(devices) == 1, f"inputs on several devices: {devices}"
    assert q.is_cuda or INTERPRETED, "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"
    if not q.is_cuda:  # free on the host; on a GPU these would stall it once per layer
        assert bool((kv_lens >= 1).all()), "every sequence has at least one position"
        assert int(kv_lens.max()) <= block_tables.shape[1] * page_size, "kv_lens past the table"
        assert int(block_tables.max()) < num_pages, "a block table names a page past the pool"

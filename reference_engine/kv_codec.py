"""The byte layout of KV pages on the wire: the one place that defines it.

A payload carrying n pages is the C-order array

    (num_layers, 2, n, page_size, num_kv_heads, head_dim)   the pool's dtype, little-endian

with index 0 of the second axis K (un-rotated) and 1 V, pages in the order of the page list;
the element type is the pools' (`config.dtype`: float32, bfloat16 or float16), the same on
both sides since they are built from one config.
The transfer backends carry these bytes unchanged; `encode_pages` reads them from a pool and
`write_pages` stores them into one. `checksum` is the `kv_checksum` fix's digest: Adler-32 over
the pages in logical order, page by page, so it does not depend on page ids or on how a
transfer was chunked.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch


def payload_nbytes(k_pool: Sequence[torch.Tensor], num_pages: int) -> int:
    _, page_size, num_kv_heads, head_dim = k_pool[0].shape
    item = k_pool[0].element_size()
    return len(k_pool) * 2 * num_pages * page_size * num_kv_heads * head_dim * item


def _gather(
    k_pool: Sequence[torch.Tensor], v_pool: Sequence[torch.Tensor], page_ids: Sequence[int]
) -> torch.Tensor:
    index = torch.tensor(list(page_ids), dtype=torch.int64, device=k_pool[0].device)
    per_layer = [torch.stack([k[index], v[index]]) for k, v in zip(k_pool, v_pool, strict=True)]
    return torch.stack(per_layer)  # (L, 2, n, P, Hkv, D)


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def encode_pages(
    k_pool: Sequence[torch.Tensor], v_pool: Sequence[torch.Tensor], page_ids: Sequence[int]
) -> bytes:
    """The payload for `page_ids` of a pool (every layer's K and V)."""
    return _to_bytes(_gather(k_pool, v_pool, page_ids))


def write_pages(
    k_pool: Sequence[torch.Tensor],
    v_pool: Sequence[torch.Tensor],
    page_ids: Sequence[int],
    payload: bytes,
) -> None:
    """Store a payload into `page_ids` of a pool; the payload must carry exactly those pages."""
    num_pages = len(page_ids)
    expected = payload_nbytes(k_pool, num_pages)
    assert len(payload) == expected, f"payload of {len(payload)} bytes, expected {expected}"
    _, page_size, num_kv_heads, head_dim = k_pool[0].shape
    blob = torch.frombuffer(bytearray(payload), dtype=k_pool[0].dtype).view(
        len(k_pool), 2, num_pages, page_size, num_kv_heads, head_dim
    )  # (L, 2, n, P, Hkv, D)
    blob = blob.to(k_pool[0].device)
    index = torch.tensor(list(page_ids), dtype=torch.int64, device=k_pool[0].device)
    for layer, (k, v) in enumerate(zip(k_pool, v_pool, strict=True)):
        k[index] = blob[layer, 0]
        v[index] = blob[layer, 1]


def checksum(
    k_pool: Sequence[torch.Tensor], v_pool: Sequence[torch.Tensor], page_ids: Sequence[int]
) -> int:
    """Adler-32 over the pages in logical order (page-major), independent of page ids."""
    if not page_ids:
        return zlib.adler32(b"")
    blob = _gather(k_pool, v_pool, page_ids).permute(2, 0, 1, 3, 4, 5)  # (n, L, 2, P, Hkv, D)
    return zlib.adler32(_to_bytes(blob))

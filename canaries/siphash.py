"""SipHash-2-4 of one 64-bit message word, vectorised over numpy lanes.

SipHash (Aumasson and Bernstein, 2012) is a keyed pseudorandom function built for short
inputs; here it is the round function of the canary cipher. Each lane hashes one 8-byte
little-endian message, so `siphash24(k0, k1, m)[i]` equals the reference SipHash-2-4 of
`m[i].to_bytes(8, "little")` under the key `k0.to_bytes(8, "little") + k1.to_bytes(8,
"little")`. numpy's uint64 arithmetic wraps modulo 2**64, which is what SipHash wants; the
state is updated in place because allocation, not arithmetic, dominates at these sizes.
Messages of other lengths are deliberately not supported.

`siphash24` uses the compiled loop `canaries._siphash` (`CORE`, 20-30x faster: it is most
of a 1M-token prompt's minting) where it was built, else the numpy rounds below
(`siphash24_numpy`); the tests hold both to the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]

_FINAL_BLOCK = np.uint64(8 << 56)  # message length 8 in the top byte, no leftover bytes
_SHIFTS = {bits: (np.uint64(bits), np.uint64(64 - bits)) for bits in (13, 16, 17, 21, 32)}


def _rotl(x: U64, bits: int, scratch: U64) -> None:
    left, right = _SHIFTS[bits]
    np.left_shift(x, left, out=scratch)
    np.right_shift(x, right, out=x)
    x |= scratch


def _rounds(v0: U64, v1: U64, v2: U64, v3: U64, scratch: U64, num: int) -> None:
    for _ in range(num):
        v0 += v1
        _rotl(v1, 13, scratch)
        v1 ^= v0
        _rotl(v0, 32, scratch)
        v2 += v3
        _rotl(v3, 16, scratch)
        v3 ^= v2
        v0 += v3
        _rotl(v3, 21, scratch)
        v3 ^= v0
        v2 += v1
        _rotl(v1, 17, scratch)
        v1 ^= v2
        _rotl(v2, 32, scratch)


def _load_core() -> Callable[[int, int, U64, U64], None] | None:
    try:
        from kvcanary.canaries._siphash import siphash24_into
    except ImportError:  # installed without a C compiler: the numpy rounds
        return None
    return siphash24_into


CORE = _load_core()


def siphash24(k0: int, k1: int, message: U64) -> U64:
    """SipHash-2-4 of each lane of `message` (one 8-byte word per lane)."""
    assert message.dtype == np.uint64
    assert message.ndim == 1
    if CORE is None:
        return siphash24_numpy(k0, k1, message)
    out = np.empty_like(message)
    CORE(k0, k1, np.ascontiguousarray(message), out)
    return out


def siphash24_numpy(k0: int, k1: int, message: U64) -> U64:
    """`siphash24` in numpy's uint64 arithmetic, one round at a time over all lanes."""
    assert message.dtype == np.uint64
    assert message.ndim == 1
    lanes = message.shape[0]
    v0 = np.full(lanes, k0 ^ 0x736F6D6570736575, dtype=np.uint64)
    v1 = np.full(lanes, k1 ^ 0x646F72616E646F6D, dtype=np.uint64)
    v2 = np.full(lanes, k0 ^ 0x6C7967656E657261, dtype=np.uint64)
    v3 = np.full(lanes, k1 ^ 0x7465646279746573, dtype=np.uint64)
    scratch = np.empty(lanes, dtype=np.uint64)
    v3 ^= message
    _rounds(v0, v1, v2, v3, scratch, 2)
    v0 ^= message
    v3 ^= _FINAL_BLOCK
    _rounds(v0, v1, v2, v3, scratch, 2)
    v0 ^= _FINAL_BLOCK
    v2 ^= np.uint64(0xFF)
    _rounds(v0, v1, v2, v3, scratch, 4)
    v0 ^= v1
    v0 ^= v2
    v0 ^= v3
    return v0

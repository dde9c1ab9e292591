"""A keyed permutation of D-bit numbers, and their spelling as base-B digits.

`FeistelCipher` is a balanced Feistel network over D = 2h bits (h <= 59) with SipHash-2-4
round functions and 8 rounds: a pseudorandom permutation, so distinct inputs give distinct,
unpredictable outputs, and decrypting a value the key never produced gives an unrelated
random input (which the minter's check bits then reject). The round number goes into the
top bits of the round function's message, so rounds are independent functions.

`to_digits` / `from_digits` spell a value `x = (left << h) | right` as `num_digits` base-B
digits (least significant first) and back, vectorised over numpy lanes with 4 limbs of at
most 30 bits so that no intermediate exceeds 64 bits (once the rest of the value fits in
64 bits, `to_digits` drops the limbs). `from_digits` flags digit strings
whose value is 2**D or more: those were never produced by the cipher.

Everything works on numpy lanes; a single value is a lane of one. Lanes are processed in
blocks that stay in cache, because at ~1e5 lanes memory traffic dominates. This module
knows nothing about canaries, words or tokens.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvcanary.canaries.siphash import U64, siphash24

NUM_ROUNDS = 8
_BLOCK_LANES = 16_384
_MAX_HALF_BITS = 59  # the round number takes the top 5 bits of the 64-bit message


class FeistelCipher:
    """A pseudorandom permutation of [0, 2**num_bits), num_bits even and <= 118."""

    def __init__(self, k0: int, k1: int, num_bits: int) -> None:
        assert num_bits % 2 == 0, num_bits
        assert 2 <= num_bits <= 2 * _MAX_HALF_BITS, num_bits
        self.num_bits = num_bits
        self.half_bits = num_bits // 2
        self._k0, self._k1 = k0, k1
        self._mask = np.uint64((1 << self.half_bits) - 1)
        self._tweaks = [np.uint64(r << _MAX_HALF_BITS) for r in range(NUM_ROUNDS)]

    def _round(self, r: int, half: U64) -> U64:
        out = siphash24(self._k0, self._k1, half | self._tweaks[r])
        out &= self._mask
        return out

    def encrypt(self, left: U64, right: U64) -> tuple[U64, U64]:
        """The images of the inputs `(left << h) | right`, as (left, right) halves."""
        return self._blocks(left, right, decrypt=False)

    def decrypt(self, left: U64, right: U64) -> tuple[U64, U64]:
        return self._blocks(left, right, decrypt=True)

    def _blocks(self, left: U64, right: U64, *, decrypt: bool) -> tuple[U64, U64]:
        out_left, out_right = np.empty_like(left), np.empty_like(right)
        for lo in range(0, left.shape[0], _BLOCK_LANES):
            part = slice(lo, lo + _BLOCK_LANES)
            a, b = left[part].copy(), right[part].copy()
            if decrypt:
                for r in reversed(range(NUM_ROUNDS)):
                    a, b = b ^ self._round(r, a), a
            else:
                for r in range(NUM_ROUNDS):
                    a, b = b, a ^ self._round(r, b)
            out_left[part], out_right[part] = a, b
        return out_left, out_right


def _limbs(left: U64, right: U64, half_bits: int) -> tuple[list[U64], list[int]]:
    low = half_bits // 2
    mask = np.uint64((1 << low) - 1)
    limbs = [left >> np.uint64(low), left & mask, right >> np.uint64(low), right & mask]
    return limbs, [half_bits - low, low, half_bits - low, low]


def to_digits(
    left: U64, right: U64, half_bits: int, base: int, num_digits: int
) -> npt.NDArray[np.int64]:
    """Digits of `(left << half_bits) | right` in `base`, shape (lanes, num_digits)."""
    assert 1 < base < 1 << 12
    limbs, widths = _limbs(left, right, half_bits)
    ubase = np.uint64(base)
    digits = np.empty((left.shape[0], num_digits), dtype=np.int64)
    bound = 1 << (2 * half_bits)  # the value is below this
    num_long = 0
    while bound > 1 << 64 and num_long < num_digits:  # long division until the rest fits
        rem = np.zeros_like(left)
        for j, width in enumerate(widths):
            limbs[j], rem = np.divmod((rem << np.uint64(width)) | limbs[j], ubase)
        digits[:, num_long] = rem
        bound = -(-bound // base)
        num_long += 1
    value = np.zeros_like(left)
    for limb, width in zip(limbs, widths, strict=True):
        value = (value << np.uint64(width)) | limb
    for d in range(num_long, num_digits):
        value, rem = np.divmod(value, ubase)
        digits[:, d] = rem
    return digits


def from_digits(
    digits: npt.NDArray[np.int64], half_bits: int, base: int
) -> tuple[U64, U64, npt.NDArray[np.bool_]]:
    """The value spelled by `digits` as (left, right) halves, and which lanes overflowed
    2**(2 * half_bits) (those lanes' halves are meaningless)."""
    lanes, num_digits = digits.shape
    zero = np.zeros(lanes, dtype=np.uint64)
    limbs, widths = _limbs(zero, zero, half_bits)
    overflow = np.zeros(lanes, dtype=np.bool_)
    ubase = np.uint64(base)
    for d in reversed(range(num_digits)):
        carry = digits[:, d].astype(np.uint64)
        for j in reversed(range(len(widths))):
            current = limbs[j] * ubase + carry  # < 2**30 * base + carry < 2**43
            limbs[j] = current & np.uint64((1 << widths[j]) - 1)
            carry = current >> np.uint64(widths[j])
        overflow |= carry != 0
    low = np.uint64(half_bits // 2)
    return (limbs[0] << low) | limbs[1], (limbs[2] << low) | limbs[3], overflow

"""SipHash against the published vectors, the Feistel permutation, the digit codec."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.canaries import siphash
from kvcanary.canaries.cipher import FeistelCipher, from_digits, to_digits
from kvcanary.canaries.siphash import siphash24, siphash24_numpy

MASK = (1 << 64) - 1


def reference_siphash24(key: bytes, message: bytes) -> int:
    """SipHash-2-4 straight from the paper, for any message length."""

    def rotl(x: int, b: int) -> int:
        return ((x << b) | (x >> (64 - b))) & MASK

    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D]
    v += [k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]

    def rounds(num: int) -> None:
        for _ in range(num):
            v[0] = (v[0] + v[1]) & MASK
            v[1] = rotl(v[1], 13) ^ v[0]
            v[0] = rotl(v[0], 32)
            v[2] = (v[2] + v[3]) & MASK
            v[3] = rotl(v[3], 16) ^ v[2]
            v[0] = (v[0] + v[3]) & MASK
            v[3] = rotl(v[3], 21) ^ v[0]
            v[2] = (v[2] + v[1]) & MASK
            v[1] = rotl(v[1], 17) ^ v[2]
            v[2] = rotl(v[2], 32)

    full = len(message) // 8 * 8
    for i in range(0, full, 8):
        m = int.from_bytes(message[i : i + 8], "little")
        v[3] ^= m
        rounds(2)
        v[0] ^= m
    last = ((len(message) & 0xFF) << 56) | int.from_bytes(message[full:], "little")
    v[3] ^= last
    rounds(2)
    v[0] ^= last
    v[2] ^= 0xFF
    rounds(4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def test_reference_matches_published_vectors() -> None:
    key = bytes(range(16))
    assert reference_siphash24(key, b"") == 0x726FDB47DD0E0E31
    assert reference_siphash24(key, bytes(range(15))) == 0xA129CA6149BE45E5
    assert reference_siphash24(key, bytes(range(8))) == 0x93F5F5799A932462


COMPILED = siphash._load_core()
IMPLEMENTATIONS = [
    pytest.param(
        "compiled",
        marks=pytest.mark.skipif(
            COMPILED is None, reason="canaries._siphash was not built (no C compiler at install)"
        ),
    ),
    "numpy",
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@settings(max_examples=25, deadline=None)
@given(
    key=st.binary(min_size=16, max_size=16),
    messages=st.lists(st.integers(0, MASK), min_size=1, max_size=40),
)
def test_vectorised_siphash_matches_reference(
    implementation: str, key: bytes, messages: list[int]
) -> None:
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    hash_lanes = siphash24 if implementation == "compiled" else siphash24_numpy
    assert (siphash.CORE is not None) == (COMPILED is not None)  # siphash24 uses the core
    got = hash_lanes(k0, k1, np.array(messages, dtype=np.uint64)).tolist()
    assert got == [reference_siphash24(key, m.to_bytes(8, "little")) for m in messages]


@pytest.mark.skipif(COMPILED is None, reason="canaries._siphash was not built")
def test_the_compiled_siphash_takes_strided_lanes_and_refuses_other_buffers() -> None:
    assert COMPILED is not None
    lanes = np.arange(20, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    strided = lanes[::2]  # not contiguous: siphash24 copies it first
    assert siphash24(1, 2, strided).tolist() == siphash24_numpy(1, 2, strided).tolist()
    out = np.empty(10, np.uint64)
    with pytest.raises(TypeError, match="uint64"):
        COMPILED(1, 2, np.zeros(10, np.int32), out)
    with pytest.raises(ValueError, match="length"):
        COMPILED(1, 2, lanes, out)


def test_feistel_is_a_permutation_and_decrypt_inverts_it() -> None:
    cipher = FeistelCipher(11, 22, 12)
    values = np.arange(1 << 12, dtype=np.uint64)
    left, right = cipher.encrypt(values >> np.uint64(6), values & np.uint64(63))
    images = (left << np.uint64(6)) | right
    assert sorted(images.tolist()) == values.tolist()
    assert (images != values).mean() > 0.99
    back_left, back_right = cipher.decrypt(left, right)
    assert ((back_left << np.uint64(6)) | back_right).tolist() == values.tolist()


def test_feistel_depends_on_the_key() -> None:
    values = np.arange(1000, dtype=np.uint64)
    a = FeistelCipher(1, 2, 70).encrypt(values, values)
    b = FeistelCipher(1, 3, 70).encrypt(values, values)
    assert (a[0] != b[0]).mean() > 0.99


@settings(max_examples=30, deadline=None)
@given(
    num_digits=st.integers(6, 10),
    seed=st.integers(0, 2**32 - 1),
)
def test_digits_round_trip_and_match_integer_arithmetic(num_digits: int, seed: int) -> None:
    base = 3480
    half = (int(num_digits * np.log2(base)) // 2 * 2) // 2
    rng = np.random.default_rng(seed)
    left = rng.integers(0, 1 << half, size=50, dtype=np.uint64)
    right = rng.integers(0, 1 << half, size=50, dtype=np.uint64)
    digits = to_digits(left, right, half, base, num_digits)
    for row, lo, hi in zip(digits.tolist(), left.tolist(), right.tolist(), strict=True):
        value = (lo << half) | hi
        assert value == sum(d * base**i for i, d in enumerate(row))
    back_left, back_right, overflow = from_digits(digits, half, base)
    assert back_left.tolist() == left.tolist()
    assert back_right.tolist() == right.tolist()
    assert not overflow.any()
    too_big = np.full((1, num_digits), base - 1, dtype=np.int64)
    assert from_digits(too_big, half, base)[2].tolist() == [True]

"""Minting canaries that name their origin to whoever holds the run's key.

A canary is `ydk` plus `num_words` words (see `canaries.shape`) of the minter's alphabet
(`canaries.alphabet`: the words chosen for the target's tokenizer). Its words spell, in
base B = the alphabet's size (the default, cl100k_base alphabet: 3,445 words, 11.75 bits
per word), the encryption under the run key of a D-bit number, D the largest even number
with 2**D <= B**num_words (70 bits for 6 words, 82 for 7, 92 for 8, 104 for 9, 116 for 10
at the default; at least 66 for 6 words in any alphabet, which has >= 2,048 words):

    plaintext = check | tenant | request | index        (most significant field first)
                D-48    8        22        18  bits      (check bits are all zero)

- tenant: 0..255; request: 0..4,194,303 (soak runs of millions of requests);
  index: 0..262,143 (a 1,048,576-token prompt at page size 16 holds ~105k canaries, at
  the smallest page size a 7-token canary allows, 13, ~150k).
- The cipher (`canaries.cipher`: 8-round Feistel, SipHash-2-4 rounds) is a keyed
  pseudorandom permutation, so a canary is a D-bit (>= 70-bit) secret: unpredictable
  without the key, distinct for distinct (tenant, request, index).
- Attribution needs no table: decrypt with the run key; the zero check bits confirm the
  canary is this run's. A canary of another run (another key) decrypts to random bits and
  passes with probability 2**-(D-48): 2**-22 (2.4e-7) for 6 words at the default
  alphabet, 2**-18 at worst. Digit strings worth 2**D or more, and words outside the
  alphabet, are never minted and rejected outright.

The key never leaves the minter: `key_id` is 8 hex characters of a keyed hash, safe for
journals and reports. This module knows nothing about prompts or scanning.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcanary.canaries.alphabet import DEFAULT_ALPHABET, MIN_LETTERS, Alphabet
from kvcanary.canaries.cipher import FeistelCipher, from_digits, to_digits
from kvcanary.canaries.costs import canary_costs
from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.shape import (
    MAX_WORDS,
    MIN_WORDS,
    TAG,
    WORD_INDEX,
    WORD_LENGTH,
    WORDS,
    canonical,
)
from kvcanary.canaries.tokenizer import Tokenizer

TENANT_BITS = 8
REQUEST_BITS = 22
INDEX_BITS = 18
PAYLOAD_BITS = TENANT_BITS + REQUEST_BITS + INDEX_BITS
NUM_TENANTS = 1 << TENANT_BITS
NUM_REQUESTS = 1 << REQUEST_BITS
NUM_INDICES = 1 << INDEX_BITS

_TAG_BYTES = np.frombuffer(TAG.encode("ascii"), dtype=np.uint8)
_WORD_BYTES = np.frombuffer("".join(" " + w for w in WORDS).encode("ascii"), np.uint8).reshape(
    len(WORDS), WORD_LENGTH + 1
)
_ATTRIBUTE_CACHE_SIZE = 65_536


_WORD_TABLE, _ROW, _TAG_ASCII = _WORD_BYTES.tobytes(), WORD_LENGTH + 1, TAG.encode("ascii")


def _load_spell() -> Callable[[Any, bytes, int, bytes], list[str]] | None:
    try:
        from kvcanary.canaries._columns import spell
    except ImportError:  # installed without a C compiler: numpy rows, then slices
        return None
    return spell


_SPELL = _load_spell()
"""`canaries._columns.spell` (`CanaryMinter.spell` in one C loop, ~5x faster than numpy
rows and a list comprehension of slices), or None when it was not built."""


def _prefix(tenant: int, request: int) -> int:
    """The plaintext bits of (tenant, request) above the index field."""
    if not 0 <= tenant < NUM_TENANTS:
        raise CanaryError(f"tenant number {tenant} outside 0..{NUM_TENANTS - 1}")
    if not 0 <= request < NUM_REQUESTS:
        raise CanaryError(f"request number {request} outside 0..{NUM_REQUESTS - 1}")
    return (tenant << (REQUEST_BITS + INDEX_BITS)) | (request << INDEX_BITS)


@dataclass(frozen=True, slots=True)
class CanaryOrigin:
    """Where a canary was laced: which tenant, which of its requests, which position."""

    tenant: int
    request: int
    index: int


def seed_key(seed: int, run_id: str) -> bytes:
    """The canary key `CanaryMinter.from_seed` uses (a keyring stores it)."""
    material = f"{seed}\x00{run_id}".encode()
    return hashlib.blake2b(material, digest_size=32, person=b"kvcanary-seed").digest()


def num_cipher_bits(num_words: int, base: int = DEFAULT_ALPHABET.size) -> int:
    """D: the largest even number of bits that `num_words` words of `base` letters spell."""
    bits = math.floor(num_words * math.log2(base))
    bits -= bits % 2
    assert 2**bits <= base**num_words
    return bits


class CanaryMinter:
    """Mints and attributes the canaries of one run key."""

    def __init__(
        self, key: bytes, *, num_words: int = MIN_WORDS, alphabet: Alphabet = DEFAULT_ALPHABET
    ) -> None:
        if len(key) < 16:
            raise CanaryError("a canary key needs at least 16 bytes (128 bits)")
        if not MIN_WORDS <= num_words <= MAX_WORDS:
            raise CanaryError(f"num_words must be {MIN_WORDS}..{MAX_WORDS}, got {num_words}")
        if alphabet.size < MIN_LETTERS:
            raise CanaryError(f"a canary alphabet needs {MIN_LETTERS} words, got {alphabet.size}")
        self.num_words = num_words
        self.alphabet = alphabet
        self.num_bits = num_cipher_bits(num_words, alphabet.size)
        self.num_check_bits = self.num_bits - PAYLOAD_BITS
        sip_key = hashlib.blake2b(key, digest_size=16, person=b"kvcanary-sip").digest()
        self.key_id = hashlib.blake2b(key, digest_size=4, person=b"kvcanary-kid").hexdigest()
        self._cipher = FeistelCipher(
            int.from_bytes(sip_key[:8], "little"),
            int.from_bytes(sip_key[8:], "little"),
            self.num_bits,
        )
        self._attributed: OrderedDict[str, CanaryOrigin | None] = OrderedDict()

    @classmethod
    def from_seed(cls, seed: int, run_id: str, **kwargs: Any) -> CanaryMinter:
        """A minter whose key is derived from (seed, run_id): reproducible runs. Whoever
        knows both can attribute the run's canaries; use `random()` when that matters."""
        return cls(seed_key(seed, run_id), **kwargs)

    @classmethod
    def random(cls, **kwargs: Any) -> CanaryMinter:
        """A minter with a fresh 256-bit key from the OS's random source."""
        return cls(secrets.token_bytes(32), **kwargs)

    def __repr__(self) -> str:
        return (
            f"CanaryMinter(key_id={self.key_id!r}, num_words={self.num_words}, "
            f"alphabet={self.alphabet.alphabet_id!r})"
        )

    def mint(self, tenant: int, request: int, index: int) -> str:
        """The canary of (tenant, request, index), e.g. `ydk settle bishop ...`."""
        return self.mint_many(tenant, request, [index])[0]

    def mint_many(self, tenant: int, request: int, indices: Sequence[int]) -> list[str]:
        """The canaries of one request at `indices`, in order."""
        return self.spell(self.mint_digits(tenant, request, indices))

    def mint_digits(
        self, tenant: int, request: int, indices: Sequence[int]
    ) -> npt.NDArray[np.int64]:
        """Word digits (indices into WORDS, of words of the alphabet), shape
        (len(indices), num_words)."""
        prefix = _prefix(tenant, request)
        if isinstance(indices, range):  # a prompt's chunks: no Python int per index
            index = np.arange(indices.start, indices.stop, indices.step, dtype=np.int64)
            ends = (indices[0], indices[-1]) if indices else (0, 0)  # min() would iterate
            low, high = min(ends), max(ends)
        else:
            index = np.asarray(indices, dtype=np.int64).reshape(-1)
            low, high = (int(index.min()), int(index.max())) if index.size else (0, 0)
        if low < 0 or high >= NUM_INDICES:
            raise CanaryError(f"canary index outside 0..{NUM_INDICES - 1}")
        return self._encrypt(index.astype(np.uint64) | np.uint64(prefix))

    def mint_requests(self, requests: Sequence[tuple[int, int, int]]) -> npt.NDArray[np.int64]:
        """The digits of canaries 0..count-1 of each (tenant, request, count), the requests'
        rows one after the other: what `mint_digits` gives for each, in one vectorised pass
        (a batch of short prompts pays the cipher's fixed cost once, not once per prompt)."""
        prefixes = np.array([_prefix(t, r) for t, r, _ in requests], np.uint64)
        counts = np.array([count for _, _, count in requests], np.int64)
        if counts.size and not 0 <= counts.min() <= counts.max() <= NUM_INDICES:
            raise CanaryError(f"canary index outside 0..{NUM_INDICES - 1}")
        firsts = np.cumsum(counts) - counts
        index = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(firsts, counts)
        return self._encrypt(index.astype(np.uint64) | np.repeat(prefixes, counts))

    def _encrypt(self, plain: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """Word digits of the canaries whose plaintexts are `plain`."""
        half = np.uint64(self._cipher.half_bits)
        left, right = self._cipher.encrypt(plain >> half, plain & np.uint64((1 << half) - 1))
        letters = to_digits(left, right, self._cipher.half_bits, self.alphabet.size, self.num_words)
        return self.alphabet.digits[letters]

    @staticmethod
    def spell(digits: npt.NDArray[np.int64]) -> list[str]:
        """Canary texts from word digits. Every word has WORD_LENGTH letters, so canaries
        of one length are fixed-width rows of bytes: one join, one decode, then slices."""
        if _SPELL is not None:  # one C loop (canaries/_columns.c)
            return _SPELL(np.ascontiguousarray(digits, np.int64), _WORD_TABLE, _ROW, _TAG_ASCII)
        num, num_words = digits.shape
        width = len(TAG) + (WORD_LENGTH + 1) * num_words
        rows = np.empty((num, width), dtype=np.uint8)
        rows[:, : len(TAG)] = _TAG_BYTES
        rows[:, len(TAG) :] = _WORD_BYTES[digits].reshape(num, -1)
        text = rows.tobytes().decode("ascii")
        return [text[start : start + width] for start in range(0, num * width, width)]

    def attribute(self, text: str) -> CanaryOrigin | None:
        """The origin of a canary of this run, or None: not this run's (or not a canary)."""
        return self.attribute_many([text])[0]

    def attribute_many(self, texts: Sequence[str]) -> list[CanaryOrigin | None]:
        """`attribute` for many texts with one vectorised decryption."""
        keys: list[str | None] = []
        for text in texts:
            try:
                keys.append(canonical(text, self.num_words))
            except CanaryError:
                keys.append(None)
        return self.attribute_canonical(keys)

    def attribute_canonical(self, keys: Sequence[str | None]) -> list[CanaryOrigin | None]:
        """`attribute_many` for texts already in canonical form with `num_words` words
        (None entries stay None); what a scanner that validated its matches calls."""
        known = {k: self._attributed[k] for k in keys if k is not None and k in self._attributed}
        todo = sorted({k for k in keys if k is not None and k not in known})
        if todo:
            fresh = dict(zip(todo, self._decrypt(todo), strict=True))
            known.update(fresh)
            self._remember(fresh)
        return [None if k is None else known[k] for k in keys]

    def _decrypt(self, texts: list[str]) -> list[CanaryOrigin | None]:
        digits = np.array([[WORD_INDEX[w] for w in t.split()[1:]] for t in texts], np.int64)
        letters = self.alphabet.position[digits]
        foreign = (letters < 0).any(axis=1)  # a word this alphabet never spells
        left, right, overflow = from_digits(
            np.maximum(letters, 0), self._cipher.half_bits, self.alphabet.size
        )
        overflow |= foreign
        left, right = self._cipher.decrypt(left, right)
        half = self._cipher.half_bits
        if half < PAYLOAD_BITS:
            valid = ~overflow & ((left >> np.uint64(PAYLOAD_BITS - half)) == 0)
        else:
            valid = ~overflow & (left == 0) & ((right >> np.uint64(PAYLOAD_BITS)) == 0)
        plain = (np.where(valid, left, 0) << np.uint64(half)) | np.where(valid, right, 0)
        origins: list[CanaryOrigin | None] = []
        for ok, value in zip(valid.tolist(), plain.tolist(), strict=True):
            origins.append(
                CanaryOrigin(
                    tenant=value >> (REQUEST_BITS + INDEX_BITS),
                    request=(value >> INDEX_BITS) & (NUM_REQUESTS - 1),
                    index=value & (NUM_INDICES - 1),
                )
                if ok
                else None
            )
        return origins

    def _remember(self, origins: dict[str, CanaryOrigin | None]) -> None:
        self._attributed.update(origins)
        while len(self._attributed) > _ATTRIBUTE_CACHE_SIZE:
            self._attributed.popitem(last=False)

    def num_tokens(self, tokenizer: Tokenizer) -> int:
        """Tokens of one canary laced into a prompt (with its leading space). In
        cl100k_base every canary has exactly this length, 1 + num_words; in tokenizers
        where some words take several tokens it is the longest a canary can be."""
        costs = canary_costs(tokenizer)
        return costs.tag + self.num_words * int(costs.words[self.alphabet.digits].max())

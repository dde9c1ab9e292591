"""A prompt's canary spans packed into one short ASCII string, and back.

What a journal keeps of a plan's canaries (`harness.record.plan_line`): every span exactly
(text, character and token offset, index), in about 14 characters per canary instead of
~90 as JSON objects. Binary, in URL-safe base64 without padding and with punctuation in
place of its capital letters (`_IN_PLACE`), then, when every text is a canary (the tag and
the same number of words of `WORDS`), "." and each word as two such characters (12 bits):

    varint num_spans, varint num_words            num_words 0: texts stored raw
    texts     (num_words 0 only) each text as varint length + UTF-8
    columns   char offsets, token offsets, indices: each as deltas from the previous value,
              a flag byte saying how: (delta, repeat) runs where few (a prompt's token
              offsets are mostly one stride, its indices 0, 1, 2, ...), one byte each where
              all fit, else zigzag varints

`unpack_spans` rejects anything malformed with a `CanaryError`: a journal line is input.
This module knows nothing about journals.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence

from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.shape import MAX_WORDS, MIN_WORDS, TAG, WORDS
from kvcanary.canaries.span import CanarySpan, spans_from_columns

_VARINTS, _RUNS, _BYTES = 0, 1, 2
_UPPER = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_IN_PLACE = b"!#$%&'()*+,:;<=>?@[]^`{|}~"
"""What stands for base64's capital letters: a packing never reads like a credential (a mixed
case run of letters and digits: issue 35's leak test greps every output for the 4-character
windows of a planted key), and nothing in it needs a JSON escape."""
_SAFE, _STANDARD = bytes.maketrans(_UPPER, _IN_PLACE), bytes.maketrans(_IN_PLACE, _UPPER)
_B64 = (_UPPER + b"abcdefghijklmnopqrstuvwxyz0123456789-_").translate(_SAFE).decode()
_WORD_CODES = {word: _B64[d >> 6] + _B64[d & 63] for d, word in enumerate(WORDS)}
"""Each word of `WORDS` as two base64url characters (12 bits: the list has < 4,096 words)."""
_WORD_OF = {code: word for word, code in _WORD_CODES.items()}
_WORD_SET = frozenset(WORDS)
assert len(WORDS) <= 64 * 64
_MAX_SPANS = 1 << 20


def pack_spans(spans: Sequence[CanarySpan]) -> str:
    """`spans` as one ASCII string that `unpack_spans` turns back into equal spans."""
    texts = [span.text for span in spans]
    words = _canonical_words(texts)
    out = bytearray()
    _varint(out, len(spans))
    _varint(out, len(words) // len(texts) if words else 0)
    if not words:
        for text in texts:
            raw = text.encode("utf-8", "surrogatepass")
            _varint(out, len(raw))
            out += raw
    _column(out, [span.char_offset for span in spans])
    _column(out, [span.token_offset for span in spans])
    _column(out, [span.index for span in spans])
    head = base64.urlsafe_b64encode(out).rstrip(b"=").translate(_SAFE).decode("ascii")
    return f"{head}.{''.join(map(_WORD_CODES.__getitem__, words))}" if words else head


def unpack_spans(packed: str) -> tuple[CanarySpan, ...]:
    """The spans `pack_spans` packed; `CanaryError` for anything that is not such a string."""
    head, _, codes = packed.partition(".")
    try:
        standard = head.encode("ascii").translate(_STANDARD)
        data = base64.urlsafe_b64decode(standard + b"=" * (-len(head) % 4))
    except (binascii.Error, ValueError) as exc:  # UnicodeEncodeError: not ASCII
        raise CanaryError(f"packed canaries are not base64: {exc}") from None
    reader = _Reader(data)
    num, num_words = reader.varint(), reader.varint()
    if num > _MAX_SPANS or (num_words and not MIN_WORDS <= num_words <= MAX_WORDS):
        raise CanaryError("packed canaries: bad header")
    texts = _unpack_words(codes, num, num_words) if num_words else reader.texts(num)
    chars, tokens, indices = (reader.column(num) for _ in range(3))
    if reader.position != len(data) or (codes and not num_words):
        raise CanaryError("packed canaries: trailing bytes")
    return spans_from_columns(texts, chars, tokens, indices)


def _canonical_words(texts: list[str]) -> list[str]:
    """The words of every text, in order, when every text is a canonical canary of one
    number of words of `WORDS` (the common case: one split for all); else []."""
    if not texts:
        return []
    num_words = texts[0].count(" ")
    words = " ".join(texts).split(" ")
    if not MIN_WORDS <= num_words <= MAX_WORDS or len(words) != len(texts) * (num_words + 1):
        return []
    if words[0 :: num_words + 1] != [TAG] * len(texts):
        return []
    del words[0 :: num_words + 1]
    return words if _WORD_SET.issuperset(words) else []


def _unpack_words(codes: str, num: int, num_words: int) -> list[str]:
    if len(codes) != 2 * num * num_words:
        raise CanaryError("packed canaries: the words do not match their count")
    try:
        words = [_WORD_OF[codes[i : i + 2]] for i in range(0, len(codes), 2)]
    except KeyError:
        raise CanaryError("packed canaries: a word outside the word list") from None
    return [" ".join([TAG, *words[i : i + num_words]]) for i in range(0, len(words), num_words)]


def _column(out: bytearray, values: list[int]) -> None:
    """`values` as deltas: one byte each where they fit, runs where they repeat, else
    zigzag varints (a flag byte says which)."""
    deltas = [b - a for a, b in zip([0, *values], values, strict=False)]
    runs = list(_runs(deltas))
    if len(runs) * 3 < len(deltas):
        out.append(_RUNS)
        for delta, repeat in runs:
            _varint(out, _zigzag(delta))
            _varint(out, repeat)
    elif all(0 <= delta < 256 for delta in deltas):
        out.append(_BYTES)
        out += bytes(deltas)
    else:
        out.append(_VARINTS)
        for delta in deltas:
            _varint(out, _zigzag(delta))


def _runs(deltas: list[int]) -> Iterator[tuple[int, int]]:
    start = 0
    for i in range(1, len(deltas) + 1):
        if i == len(deltas) or deltas[i] != deltas[start]:
            yield deltas[start], i - start
            start = i


def _zigzag(value: int) -> int:
    return value * 2 if value >= 0 else -value * 2 - 1


def _varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


class _Reader:
    """Reads a packed string's bytes, every overrun a `CanaryError`."""

    def __init__(self, data: bytes) -> None:
        self._data, self.position = data, 0

    def take(self, num: int) -> bytes:
        if self.position + num > len(self._data):
            raise CanaryError("packed canaries: truncated")
        chunk = self._data[self.position : self.position + num]
        self.position += num
        return chunk

    def varint(self) -> int:
        value = shift = 0
        while True:
            byte = self.take(1)[0]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise CanaryError("packed canaries: a number out of range")

    def texts(self, num: int) -> list[str]:
        try:
            return [self.take(self.varint()).decode("utf-8", "surrogatepass") for _ in range(num)]
        except UnicodeDecodeError:
            raise CanaryError("packed canaries: a text is not UTF-8") from None

    def column(self, num: int) -> list[int]:
        kind = self.take(1)[0]
        if kind not in (_VARINTS, _RUNS, _BYTES):
            raise CanaryError("packed canaries: unknown column kind")
        deltas: list[int] = list(self.take(num)) if kind == _BYTES else []
        while len(deltas) < num:
            delta = _unzigzag(self.varint())
            repeat = self.varint() if kind == _RUNS else 1
            if repeat < 1 or len(deltas) + repeat > num:
                raise CanaryError("packed canaries: a run overruns its column")
            deltas += [delta] * repeat
        values, total = [], 0
        for delta in deltas:
            total += delta
            values.append(total)
        return values


def _unzigzag(value: int) -> int:
    return value >> 1 if not value & 1 else -(value >> 1) - 1

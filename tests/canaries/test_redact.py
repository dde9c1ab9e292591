"""Redaction keeps the canaries and nothing else of a foreign response."""

from __future__ import annotations

import hashlib
import re

import pytest

from kvcanary.canaries import CanaryError, CanaryIndex, CanaryMinter, Hit, Owner, redact
from kvcanary.canaries.redact import redact_quote

SECRET = "customer 4471 ordered 3 widgets, card ending 9921"


def test_keeps_hits_and_replaces_everything_else(minter: CanaryMinter) -> None:
    a, b = minter.mint_many(1, 1, range(2))
    index = CanaryIndex(minter)
    index.add_many([(a, Owner("t", "r")), (b, Owner("t", "r"))])
    text = f"{SECRET}. {a.upper()} and then {b}\n{SECRET}"
    hits = index.scan(text)
    assert len(hits) == 2
    out = redact(text, hits)
    assert a.upper() in out
    assert b in out
    assert "4471" not in out
    assert "widgets" not in out
    assert "and then" not in out
    markers = re.findall(r"\[… (\d+) chars redacted, sha256:([0-9a-f]{8}) …\]", out)
    gaps = [text[: hits[0].start], text[hits[0].end : hits[1].start], text[hits[1].end :]]
    assert markers == [
        (str(len(gap)), hashlib.sha256(gap.encode()).hexdigest()[:8]) for gap in gaps
    ]
    assert re.sub(r"\[… [^]]* …\]", "", out) == a.upper() + b


def sha8(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def make_hit(start: int, end: int, text: str) -> Hit:
    return Hit(text[start:end], start, end, "exact", None, None, None)


def test_overlapping_and_adjacent_hits_and_edges() -> None:
    text = "0123456789"
    hits = [make_hit(2, 5, text), make_hit(4, 7, text), make_hit(7, 8, text), make_hit(0, 1, text)]
    out = redact(text, hits)
    assert out.startswith("0[… 1 chars redacted")
    assert "234567" in out
    assert out.endswith(f"[… 2 chars redacted, sha256:{sha8('89')} …]")
    assert redact(text, []) == f"[… 10 chars redacted, sha256:{sha8(text)} …]"
    assert redact("", []) == ""
    assert redact(text, [make_hit(0, 10, text)]) == text


def test_hits_outside_the_text_are_an_error() -> None:
    with pytest.raises(CanaryError, match="outside"):
        redact("short", [Hit("x", 3, 9, "exact", None, None, None)])


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        ('HTTP 500: {"error": "their text"}', "HTTP 500: "),
        ("StreamViolation: error event in stream: their text", "error event in stream: "),
        ("StreamViolation: malformed JSON: {their", "StreamViolation: malformed JSON: "),
        ("RemoteProtocolError: illegal header line: b'their'", "illegal header line: "),
    ],
)
def test_redact_quote_keeps_the_lead_in_and_hides_the_quote(message: str, kept: str) -> None:
    redacted = redact_quote(message)
    quote = message[message.index(kept) + len(kept) :]
    assert redacted.startswith(message[: message.index(kept) + len(kept)])
    assert "their" not in redacted
    digest = hashlib.sha256(quote.encode()).hexdigest()[:8]
    assert redacted.endswith(f"[… {len(quote)} chars redacted, sha256:{digest} …]")
    assert redact_quote(redacted) == redacted  # redacting twice changes nothing


@pytest.mark.parametrize(
    "message",
    [
        "no complete response within the 5.0 s deadline",
        "ConnectError: [Errno 111] Connection refused",
        "StreamViolation: `choices` is not a list",
        "HTTP 502: ",
        "",
    ],
)
def test_redact_quote_leaves_messages_that_quote_nothing(message: str) -> None:
    assert redact_quote(message) == message

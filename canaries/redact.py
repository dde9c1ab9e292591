"""Redacting a response down to the canaries found in it.

Against a real deployment, the text around a leaked canary may be another customer's
data. `redact` keeps every hit span verbatim and replaces each run of other text with a
marker that says how long it was and gives a short SHA-256 of it, so evidence can be
compared without being disclosed: `[… 1234 chars redacted, sha256:0123abcd …]`.

`scrub_secrets` removes credentials a target echoed back (some gateways and debug servers
quote the Authorization header in error bodies): every occurrence of a tenant's secret is
replaced by `[credential redacted]`, in raw evidence too.

`redact_quote` does for an error message what `redact` does for a response: the target's
own words in it (a 5xx body, an error event, a malformed line, quoted after the harness's
`lead-in: `) may be another customer's data too, so they become the same marker; the
lead-in, which says what went wrong, stays.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcanary.canaries.errors import CanaryError

if TYPE_CHECKING:  # the package imports this module eagerly, and `hit` pulls in numpy
    from kvcanary.canaries.hit import Hit


def redact(text: str, hits: Sequence[Hit]) -> str:
    """`text` with everything outside the hits' spans replaced by markers."""
    spans = sorted((hit.start, hit.end) for hit in hits)
    if spans and (spans[0][0] < 0 or max(end for _, end in spans) > len(text)):
        raise CanaryError("hit offsets lie outside the text being redacted")
    out: list[str] = []
    position = 0
    for start, end in spans:
        if start > position:
            out.append(_marker(text[position:start]))
        if end > position:
            out.append(text[max(start, position) : end])
            position = end
    if position < len(text):
        out.append(_marker(text[position:]))
    return "".join(out)


def _marker(hidden: str) -> str:
    digest = hashlib.sha256(hidden.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"[… {len(hidden)} chars redacted, sha256:{digest} …]"


MIN_SECRET_CHARS = 6
"""Shorter values (a test's `x`) would scrub ordinary text; no real credential is this short."""
SECRET_MARKER = "[credential redacted]"


def scrub_secrets(text: str, secrets: Sequence[str]) -> str:
    """`text` with every occurrence of each secret (longest first) replaced by a marker."""
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= MIN_SECRET_CHARS and secret in text:
            text = text.replace(secret, SECRET_MARKER)
    return text


_EXCEPTION_NAME = re.compile(r"[A-Z][A-Za-z0-9]*: ")
"""`StreamViolation: ...`, `RemoteProtocolError: ...`: the name before the lead-in."""
_MARKER = re.compile(r"\[… \d+ chars redacted, sha256:[0-9a-f]{8} …\]")


def redact_quote(message: str) -> str:
    """`message` with everything after its lead-in (up to the first `: `, past a leading
    exception name) replaced by a marker: `HTTP 500: {...}` -> `HTTP 500: [… 17 chars
    redacted, sha256:… …]`. A message that quotes nothing (no `: `), or whose quote is
    already a marker, is returned as it is."""
    name = _EXCEPTION_NAME.match(message)
    start = name.end() if name else 0
    colon = message.find(": ", start)
    quote = message[colon + 2 :] if colon >= 0 else ""
    if not quote or _MARKER.fullmatch(quote):
        return message
    return message[: colon + 2] + _marker(quote)

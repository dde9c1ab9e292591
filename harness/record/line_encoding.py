"""A journal line from an event: `encode_event` (what `harness.record.journal` writes) and
the prefixes every line starts with (what fast readers pick lines by).

Lines are compact, strict JSON (NaN and infinities written as null) and ASCII-only: every
other character escaped as `json.dumps` escapes it, so a lone surrogate from a broken stream
stays representable. Encoded by orjson where it is installed (several times faster than
`json`), its UTF-8 then escaped; `json` writes what orjson refuses (a lone surrogate, an
integer beyond 64 bits), the same line.
"""

from __future__ import annotations

import json
import math
import re
from enum import Enum
from pathlib import Path
from typing import Any

from kvcanary.harness.record.events import RECORD_BODIES, Event, to_record

RECORD_START = b'{"type":"'
"""How `encode_event` starts every line: compact JSON, the record's `type` first."""
REQUEST_LINE_PREFIXES: dict[str, bytes] = {
    record_type: RECORD_START + record_type.encode() + b'","request_id":"'
    for record_type in RECORD_BODIES
}
"""How `encode_event` starts each request record's line (`plan`, `observation`): `type`, then
the request id (its body's first field). Fast readers pick lines by these prefixes; a line
that does not start with one is read whole."""


def encode_event(event: Event) -> bytes:
    """One journal line (with its newline) for `event`: ASCII-only, strict JSON, starting
    with `RECORD_START` (and a request record with its `REQUEST_LINE_PREFIXES` entry)."""
    record = to_record(event)
    if _orjson is not None:
        try:
            raw = _orjson.dumps(record, default=_json_default, option=_ORJSON_OPTIONS)
        except (TypeError, _orjson.JSONEncodeError):
            pass
        else:
            if not raw.isascii():
                raw = _NON_ASCII.sub(_escape, raw.decode("utf-8")).encode("ascii")
            return raw + b"\n"
    try:
        text = json.dumps(record, separators=(",", ":"), allow_nan=False, default=_json_default)
    except ValueError:  # a NaN/inf somewhere (e.g. a detector's detail): strict JSON has none
        text = json.dumps(
            _finite(record), separators=(",", ":"), allow_nan=False, default=_json_default
        )
    # ensure_ascii (the default) keeps lone surrogates from a broken stream representable.
    return text.encode("ascii") + b"\n"


try:
    import orjson as _orjson
except ImportError:  # optional: `json` writes the same lines, slower
    _orjson = None  # type: ignore[assignment]
_ORJSON_OPTIONS = 0 if _orjson is None else _orjson.OPT_NON_STR_KEYS
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def _escape(match: re.Match[str]) -> str:
    """A non-ASCII character as `json.dumps` escapes it (astral ones as a surrogate pair)."""
    code = ord(match.group())
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 | (code >> 10):04x}\\u{0xDC00 | (code & 0x3FF):04x}"


def _json_default(value: object) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    raise TypeError(f"journal cannot serialise {type(value).__name__}: {value!r}")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value

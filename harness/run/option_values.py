"""Option values: how one setting's text becomes a value, for every source that gives it.

Each parser takes the text a flag, an ini line or a TOML value spelled, and returns the value
or raises `ValueError` with a message that reads after the name of its source
(`argument --tenants: expected a positive integer, got 'zero'`). These are the one URL check
and the one environment-variable-name check of the harness: commands, the plugin, config
files and scenarios all call them.

It knows nothing of options, sources or precedence; `harness.run.options` and
`harness.run.config` do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from urllib.parse import urlsplit

from kvcanary.harness.target.urls import redact_url
from kvcanary.tenants.tenant import env_name_problem

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_URL = re.compile(r"^https?://[^/\s]+")
MAX_DURATION_S = 366 * 86400.0
"""The longest duration any setting takes (a year's soak); longer ones overflow clocks."""

# Bounds of the registry's numbers, checked while a value is parsed (before anything is
# sized by it).
MAX_TENANTS = 256
"""A canary names its tenant in 8 bits (`canaries.mint.NUM_TENANTS`)."""
MAX_REQUESTS = 4_194_304
"""A canary names its request in 22 bits (`canaries.mint.NUM_REQUESTS`)."""
MAX_TOKENS = 100_000_000
"""A pool or context larger than any deployment's; a prompt this long is ~400 MB of text."""
MAX_CONCURRENCY = 4096
"""Requests in flight, each its own connection."""
MAX_BUDGET = 10**15


def parse_duration(text: str) -> float:
    """Seconds from `30s`, `10m`, `8h`, `1h30m`, `250ms` or a bare number of seconds."""
    text = text.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
            pos = match.end()
        if pos != len(text) or not text:
            raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 10m, 8h)") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a duration must be positive, got {text!r}")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"a duration must be at most 366d, got {text!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """The short form `parse_duration` reads back (`90` -> `1m30s`)."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    parts, rest = [], round(seconds)
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(parts) or "0s"


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB)", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_retention(text: str) -> str:
    """A retention as the user wrote it, checked: an age (`24h`, `7d`) or a size on disk
    (`500MB`, `20GB`)."""
    size = _SIZE.fullmatch(text.strip())
    if size is not None:
        if float(size.group(1)) <= 0:
            raise ValueError(f"expected a positive size, got {text!r}")
        return text.strip()
    try:
        parse_duration(text)
    except ValueError:
        raise ValueError(
            f"expected an age (24h, 7d) or a size (500MB, 20GB), got {text!r}"
        ) from None
    return text.strip()


def retention_limits(text: str | None) -> tuple[float | None, int | None]:
    """(max age in seconds, max bytes) of a retention; (None, None): keep everything."""
    if text is None:
        return None, None
    size = _SIZE.fullmatch(text.strip())
    if size is not None:
        return None, int(float(size.group(1)) * _SIZE_UNITS[size.group(2).lower()])
    return parse_duration(text), None


def parse_positive_int(text: str) -> int:
    return _whole_number(text, 1, None)


def parse_non_negative_int(text: str) -> int:
    return _whole_number(text, 0, None)


def int_within(low: int, high: int, why: str = "") -> Callable[[str], int]:
    """A parser of whole numbers from `low` to `high`; `why` says where the bound comes
    from. Bounds are checked on the text's value, before anything is sized by it."""

    def parse(text: str) -> int:
        return _whole_number(text, low, high, why)

    return parse


def float_within(low: float, high: float, why: str = "") -> Callable[[str], float]:
    """A parser of finite numbers from `low` to `high` (`1e-300` is not a rate)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"expected a number from {low:g} to {high:g}{why}, got {text!r}")
        return value

    return parse


def _whole_number(text: str, low: int, high: int | None, why: str = "") -> int:
    value: int | None = None
    if len(text.strip()) <= 30:  # int() of a very long text costs quadratic time
        try:
            value = int(text)
        except ValueError:
            value = None
    if value is not None and value >= low and (high is None or value <= high):
        return value
    if value is not None and high is not None:
        raise ValueError(f"expected a whole number from {low:,} to {high:,}{why}, got {text!r}")
    wanted = "a positive integer" if low == 1 else f"an integer >= {low}"
    raise ValueError(f"expected {wanted}, got {text!r}")


def parse_positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def parse_prices(text: str) -> tuple[float, float]:
    """`IN,OUT`: prices per million prompt and completion tokens (each >= 0)."""
    parts = text.split(",")
    try:
        prices = tuple(float(part) for part in parts)
    except ValueError:
        prices = ()
    if len(prices) != 2 or not all(math.isfinite(p) and p >= 0 for p in prices):
        raise ValueError(f"expected IN,OUT prices per million tokens (e.g. 0.15,0.6), got {text!r}")
    return prices[0], prices[1]


def parse_port(text: str) -> int:
    """A TCP port, 1-65535."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"expected a port number 1-65535, got {text!r}")
    return port


def parse_url(text: str) -> str:
    """An http(s) base URL, without trailing slashes (paths are joined onto it).

    A URL with credentials in it (`user:password@host`) is refused, never echoed: a key is
    given by the name of the variable that holds it (`--api-key-env`)."""
    shown = redact_url(text)
    if not _URL.match(text):
        raise ValueError(f"not an http(s) URL: {shown!r}")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:  # a port past 65535, a broken IPv6 literal (its text is not quoted:
        # in `http://user:pa/ss@host` the "port" is the start of a password)
        raise ValueError(f"not a usable URL (a port of 1-65535 and a host): {shown!r}") from None
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "the URL carries credentials (user:password@host), which kvcanary never takes "
            "from a URL: put the key in an environment variable and name it with "
            "--api-key-env VAR"
        )
    if port == 0 or not parts.hostname:
        raise ValueError(f"not a usable URL (no host, or port 0): {shown!r}")
    return text.rstrip("/")


def parse_env_name(text: str) -> str:
    """The NAME of an environment variable; never echoes the text (it may be a pasted key)."""
    problem = env_name_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


def parse_text(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a non-empty value")
    return text

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

from kvcanary.tenants.tenant import env_name_problem

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_URL = re.compile(r"^https?://[^/\s]+")


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


def parse_positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def parse_non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return value


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
    """An http(s) base URL, without trailing slashes (paths are joined onto it)."""
    if not _URL.match(text):
        raise ValueError(f"not an http(s) URL: {text!r}")
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

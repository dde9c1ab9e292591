"""URLs as kvcanary shows them: never with the credentials a user may have put in them."""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import urlsplit

API_SUFFIX = "/v1"
"""What an OpenAI client's base URL ends with; kvcanary's targets are the server's root."""


def redact_url(url: str) -> str:
    """The URL without a `user:password@` part (everything up to the last `@` of the
    authority, so a password with a `/` in it is hidden too)."""
    return re.sub(r"//[^@\s]*@", "//***@", url, count=1)


def server_root(url: str, note: Callable[[str], None] | None = None) -> str:
    """The server's root for a base URL given the way OpenAI clients take it (`.../v1`):
    kvcanary joins `/v1/models`, `/metrics`, `/health` onto the root. `note` is told once
    when the URL was changed."""
    root = url.rstrip("/")
    if not urlsplit(root).path.endswith(API_SUFFIX):
        return root
    root = root.removesuffix(API_SUFFIX)
    if note is not None:
        note(f"target: using {redact_url(root)} (the server's root; kvcanary adds {API_SUFFIX})")
    return root

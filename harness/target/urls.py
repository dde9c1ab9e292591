"""URLs as kvcanary shows them: never with the credentials a user may have put in them."""

from __future__ import annotations

import re


def redact_url(url: str) -> str:
    """The URL without a `user:password@` part."""
    return re.sub(r"//[^/@\s]+@", "//***@", url)

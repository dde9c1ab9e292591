"""The one exception the canaries package raises for bad input.

`CanaryError` covers everything a caller can get wrong: an unknown tokenizer spec, a page
size no canary fits, a tenant or request number outside the canary's bit fields, a string
that is not canary-shaped. It subclasses `ValueError`, and the harness maps it to a
one-line user error. Transport failures of `RemoteTokenizer` are httpx's own exceptions,
left for the harness to map; only protocol surprises (no tokenize route, a malformed body)
become `CanaryError`.
"""

from __future__ import annotations


class CanaryError(ValueError):
    """Bad input to canary minting, tokenization, prompt building or detection."""

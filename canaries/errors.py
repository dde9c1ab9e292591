"""The one exception tree of kvcanary, rooted in its lowest layer.

    KvcanaryError
    ├── ConfigError      bad flags, config file, scenario, limits or tokenizer -> exit 2
    │   └── CanaryError  bad input to canary minting, tokenizing, prompt building or detection
    └── RunIncomplete    target unreachable, interrupted before a verdict       -> exit 3

Every package raises these (canaries, tenants, harness, reports and the reference engine's
command line); `harness.cli` maps them to exit statuses, in one place. Each message is one
line a user can act on; no traceback is shown for these. Transport failures of
`RemoteTokenizer` are httpx's own exceptions, left for the harness to map; only protocol
surprises (no tokenize route, a malformed body) become `CanaryError`.
"""

from __future__ import annotations


class KvcanaryError(Exception):
    """Base of every error kvcanary reports to a user as a one-line message."""


class ConfigError(KvcanaryError):
    """The user's input (flags, config file, scenario, limits) cannot be used."""


class CanaryError(ConfigError, ValueError):
    """Bad input to canary minting, tokenization, prompt building or detection.

    Also a `ValueError`, so callers that validate values generically still catch it.
    """


class RunIncomplete(KvcanaryError):
    """The run could not produce a verdict (target unreachable, interrupted too early)."""

"""Errors a user can cause or meet, mapped to exit statuses in one place (`harness.cli`).

    KvcanaryError
    ├── ConfigError      bad flags, config file, scenario or limits      -> exit 2
    └── RunIncomplete    target unreachable, interrupted before a verdict -> exit 3

Each message is one line a user can act on; no traceback is shown for these.
"""

from __future__ import annotations


class KvcanaryError(Exception):
    """Base of every error kvcanary reports to a user as a one-line message."""


class ConfigError(KvcanaryError):
    """The user's input (flags, config file, scenario, limits) cannot be used."""


class RunIncomplete(KvcanaryError):
    """The run could not produce a verdict (target unreachable, interrupted too early)."""

"""kvcanary: canary-marker tests for cross-tenant KV-cache leakage in LLM serving deployments.

The project's top-level folders (`harness/`, `canaries/`, `tenants/`, `reports/`,
`reference_engine/`) are this package's subpackages: `kvcanary/harness` links to `../harness`
and so on, so every import name is the project's own (`kvcanary.harness`, ...) and nothing
clashes with a user's top-level modules when the pytest plugin loads into their test process.
`docs/architecture.md` draws the layers.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("kvcanary")
except metadata.PackageNotFoundError:  # a checkout on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["__version__"]

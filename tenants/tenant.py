"""A simulated tenant: a name, credentials by reference, extra headers, a cache salt, a weight.

A tenant knows *where* its credentials live (the name of an environment variable) and
resolves them only when a request is about to be sent, so a key never sits in a plan, a
journal or a report. `to_record` is the only view of a tenant that may be written anywhere.
It deliberately knows nothing about requests, prompts or transport.

A header value written `${NAME}` is read from environment variable NAME at send time, for
deployments that take a secret in a header other than `Authorization` (e.g. `api-key`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcanary.canaries.errors import ConfigError

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token


def env_name_problem(text: str) -> str | None:
    """Why `text` is not the NAME of an environment variable, or None if it is one.

    The one rule for every place a credential is referenced (flags, config files, scenarios,
    tenant files). The text may be a key pasted by mistake, so the message never shows it:
    only its length.
    """
    if _ENV_NAME.fullmatch(text):
        return None
    return (
        "expected the NAME of an environment variable (letters, digits, '_'), not a key; "
        f"got a value of {len(text)} characters"
    )


@dataclass(frozen=True, slots=True)
class Tenant:
    """One simulated customer of the target. Holds no secret, only where to find it."""

    name: str
    api_key_env: str | None = None
    """Name of the environment variable holding this tenant's API key (sent as a Bearer token)."""
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Extra request headers; a value `${NAME}` is read from the environment at send time."""
    cache_salt: str | None = None
    """Sent as `cache_salt` in the request body (vLLM's per-tenant prefix-cache isolation)."""
    weight: float = 1.0
    """Relative share of this tenant's requests in a workload."""

    def __post_init__(self) -> None:
        if not _TENANT_NAME.fullmatch(self.name):
            raise ConfigError(
                f"tenant name {self.name!r} must be 1-64 letters, digits, '.', '_' or '-'"
            )
        problem = None if self.api_key_env is None else env_name_problem(self.api_key_env)
        if problem is not None:
            raise ConfigError(f"tenant {self.name!r}: api_key_env: {problem}")
        for header in self.headers:
            if not _HEADER_NAME.fullmatch(header):
                raise ConfigError(f"tenant {self.name!r}: {header!r} is not a valid header name")
            if self.api_key_env is not None and header.lower() == "authorization":
                raise ConfigError(
                    f"tenant {self.name!r}: give either api_key_env or an Authorization header, "
                    "not both"
                )
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ConfigError(f"tenant {self.name!r}: weight must be a positive number")
        # a private copy (not a read-only proxy, so tenants still pickle and `asdict`)
        object.__setattr__(self, "headers", dict(self.headers))

    def secrets(self, environ: Mapping[str, str] = os.environ) -> set[str]:
        """What this tenant sends that must never be journaled: every header value it adds,
        and a bearer token without its scheme."""
        found: set[str] = set()
        for value in self.auth_headers(environ).values():
            found.add(value)
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                found.add(token)
        return found

    def auth_headers(self, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """Every header this tenant adds to a request, credentials resolved from `environ` now."""
        resolved: dict[str, str] = {}
        if self.api_key_env is not None:
            resolved["Authorization"] = f"Bearer {self._lookup(self.api_key_env, environ)}"
        for header, value in self.headers.items():
            resolved[header] = _ENV_REFERENCE.sub(
                lambda match: self._lookup(match.group(1), environ), value
            )
        return resolved

    def env_names(self) -> list[str]:
        """The environment variables this tenant's credentials are read from."""
        names = [] if self.api_key_env is None else [self.api_key_env]
        for value in self.headers.values():
            names.extend(match.group(1) for match in _ENV_REFERENCE.finditer(value))
        return names

    def to_record(self) -> dict[str, Any]:
        """The journal's view: names of variables and headers, never their values."""
        return {
            "name": self.name,
            "api_key_env": self.api_key_env,
            "header_names": sorted(self.headers),
            "has_cache_salt": self.cache_salt is not None,
            "weight": self.weight,
        }

    def _lookup(self, variable: str, environ: Mapping[str, str]) -> str:
        value = environ.get(variable)
        if not value:
            raise ConfigError(
                f"tenant {self.name!r}: environment variable {variable} is not set or empty"
            )
        return value


def all_secrets(tenants: Iterable[Tenant]) -> tuple[str, ...]:
    """Every credential value of `tenants`, once each: what is scrubbed from whatever the
    target sends back."""
    return tuple({secret for tenant in tenants for secret in tenant.secrets()})


def default_tenants(n: int = 4, api_key_env: str | None = None) -> list[Tenant]:
    """`n` equally weighted tenants `tenant-0` ... sharing one key variable (or none)."""
    if n < 1:
        raise ConfigError(f"the number of tenants must be at least 1, got {n}")
    return [Tenant(name=f"tenant-{i}", api_key_env=api_key_env) for i in range(n)]

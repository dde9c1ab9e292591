"""What the pytest plugin checks when a session starts, before any test runs.

A session pointed at a target that cannot be used would otherwise fail every kvcanary test
with the same message (nine, with the suite): a credential variable that is not set, or a
target that does not answer. Both are settled here, once, as one line the plugin turns into
pytest's usage error (exit 4):

    credentials   every tenant's key variable is set (`Tenant.auth_headers`, as a run checks)
    reachability  a remote target answers one GET of `/v1/models` within the discovery
                  timeout; any HTTP status counts as an answer (a 401 says the key is wrong,
                  which the runs report better than this check could)

The bundled engine is not started here: it starts on first use, and a session that never
uses it pays nothing. Nothing here knows about pytest.
"""

from __future__ import annotations

import asyncio

import httpx

from kvcanary.canaries.errors import RunIncomplete
from kvcanary.harness.run.config import RunConfig
from kvcanary.harness.run.wiring import check_credentials
from kvcanary.harness.target.discovery_fetch import DISCOVERY_TIMEOUT_S
from kvcanary.harness.target.server_info import read_engine_facts
from kvcanary.tenants.tenant import default_tenants


def preflight(config: RunConfig) -> None:
    """Raises `ConfigError` for an unset credential variable and `RunIncomplete` for a
    remote target that does not answer."""
    tenants = default_tenants(config.tenants, config.api_key_env)
    check_credentials(tenants)
    if config.target is None:
        return
    timeout_s = min(config.timeout, DISCOVERY_TIMEOUT_S)
    headers = tenants[0].auth_headers()
    why = asyncio.run(_unreachable(config.target, headers, timeout_s))
    if why is not None:
        raise RunIncomplete(
            f"cannot reach the target at {config.target} ({why}); check --kvcanary-target"
        )


async def _unreachable(base_url: str, headers: dict[str, str], timeout_s: float) -> str | None:
    """Why the target at `base_url` does not answer, or None when it does."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        facts = await read_engine_facts(
            client, base_url, headers=headers, limits_known=True, timeout_s=timeout_s
        )
    if facts.reachable:
        return None
    errors = [attempt.error for attempt in facts.attempts if attempt.error]
    return errors[0] if errors else "no response"

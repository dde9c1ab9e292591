"""Whether the bundled engine's extra (`kvcanary[engine]`) is installed, checked without
importing it, so the harness and `kvcanary serve` can say how to install it in one line."""

from __future__ import annotations

import importlib.util

from kvcanary.canaries.errors import ConfigError

ENGINE_MODULES = ("torch", "fastapi", "uvicorn", "prometheus_client")
INSTALL_HINT = "pip install 'kvcanary[engine]'"


def missing_engine_modules() -> tuple[str, ...]:
    """The engine extra's modules that cannot be imported here."""
    return tuple(name for name in ENGINE_MODULES if importlib.util.find_spec(name) is None)


def require_engine(what: str, *, alternative: str | None = None) -> None:
    """Raise a one-line `ConfigError` when `what` needs the engine extra and it is missing."""
    missing = missing_engine_modules()
    if missing:
        raise ConfigError(
            f"{what} needs the bundled reference engine, which is not installed "
            f"(missing: {', '.join(missing)}): install it with {INSTALL_HINT}"
            + (f", or {alternative}" if alternative else "")
        )

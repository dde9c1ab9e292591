"""Run settings: one validated dataclass built from defaults, a TOML file and flags.

Precedence is flags over the config file over the defaults in `harness.run.options`. The file
holds a `[run]` table (any option `kvcanary run` takes) and, for `kvcanary soak`, an
optional `[soak]` table whose keys override `[run]`. Unknown tables, unknown keys and bad
values are `ConfigError`s that name the file and the key.

This module knows which combinations make sense (`--requests` with `--duration` does not).
It does not touch the network, the environment or the engine; `harness.run.session` does.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from canaries.errors import ConfigError
from harness.run.options import OPTIONS_BY_NAME, Option, options_for

Command = Literal["run", "soak"]

DEFAULT_NUM_REQUESTS = 60
DEFAULT_CONCURRENCY = 8
DEFAULT_ENGINE_CONCURRENCY = 1
"""The bundled engine is CPU-bound: one request at a time is as fast on a small machine,
and keeps its time-to-first-token clean enough for the timing detector."""

# Pairs where one source may name only one side; a higher source naming either side
# replaces the whole pair from lower sources.
_EXCLUSIVE = (("requests", "duration"), ("concurrency", "rate"))


def _default(name: str) -> Any:
    return OPTIONS_BY_NAME[name].default


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Everything `kvcanary run` / `soak` (and the pytest plugin) needs to start a run."""

    command: Command = "run"
    target: str | None = _default("target")
    model: str | None = _default("model")
    api: Literal["chat", "completions"] = _default("api")
    tenants: int = _default("tenants")
    requests: int | None = _default("requests")
    duration: float | None = _default("duration")
    concurrency: int | None = _default("concurrency")
    rate: float | None = _default("rate")
    pool_tokens: int | None = _default("pool_tokens")
    context_tokens: int | None = _default("context_tokens")
    page_size: int | None = _default("page_size")
    tokenizer: str = _default("tokenizer")
    api_key_env: str | None = _default("api_key_env")
    profile: str = _default("profile")
    seed: int | None = _default("seed")
    timeout: float = _default("timeout")
    out: str | None = _default("out")
    keep_raw_evidence: bool = _default("keep_raw_evidence")
    engine_preset: str = _default("engine_preset")
    engine_fix: tuple[str, ...] = _default("engine_fix")
    engine_prefix_cache: bool = _default("engine_prefix_cache")
    cache_probe: bool = _default("cache_probe")
    cache_probe_trials: int = _default("cache_probe_trials")
    cache_probe_salts: bool = _default("cache_probe_salts")
    report_every: float = _default("report_every")
    rotate_every: float = _default("rotate_every")
    force: bool = _default("force")

    def __post_init__(self) -> None:
        if self.requests is not None and self.duration is not None:
            raise ConfigError("give --requests or --duration, not both")
        if self.concurrency is not None and self.rate is not None:
            raise ConfigError("give --concurrency (closed loop) or --rate (open loop), not both")
        if self.command == "soak" and self.duration is None:
            raise ConfigError("kvcanary soak needs --duration (e.g. --duration 8h)")
        if self.tenants < 2:
            raise ConfigError("--tenants must be at least 2: a cross-tenant leak needs two")
        if self.target is not None and (
            self.engine_fix
            or self.engine_preset != _default("engine_preset")
            or self.engine_prefix_cache
        ):
            raise ConfigError(
                "--engine-preset/--engine-fix/--engine-prefix-cache apply only without --target"
            )
        if self.cache_probe_trials < 5:  # harness.cache_probe.probe's minimum (not imported: scipy)
            raise ConfigError(
                f"--cache-probe-trials must be at least 5, got {self.cache_probe_trials}"
            )

    @property
    def num_requests(self) -> int | None:
        """The request budget, or None for a duration-bound run."""
        if self.duration is not None:
            return None
        return self.requests if self.requests is not None else DEFAULT_NUM_REQUESTS

    @property
    def num_workers(self) -> int | None:
        """Closed-loop concurrency, or None for an open-loop (Poisson) run."""
        if self.rate is not None:
            return None
        if self.concurrency is not None:
            return self.concurrency
        return DEFAULT_CONCURRENCY if self.target is not None else DEFAULT_ENGINE_CONCURRENCY

    def to_record(self) -> dict[str, Any]:
        """The settings as journaled in `run_started` (no credential values exist here)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def resolve(
    command: Command, flags: Mapping[str, Any], config_path: str | Path | None = None
) -> RunConfig:
    """The run's settings: `flags` (given on the command line) over the file over defaults."""
    allowed = {option.name for option in options_for(command) if option.in_file}
    _check_exclusive(flags, "the command line")
    values: dict[str, Any] = {}
    if config_path is not None:
        values = load_config_file(config_path, command)
    for name, value in flags.items():
        if name not in allowed:
            continue
        for pair in _EXCLUSIVE:
            if name in pair:
                for other in pair:
                    values.pop(other, None)
        values[name] = value
    return RunConfig(command=command, **values)


def load_config_file(path: str | Path, command: Command) -> dict[str, Any]:
    """Parsed, validated option values from a TOML file's `[run]` (and `[soak]`) tables."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path}: not found") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    for table in document:
        if table not in ("run", "soak"):
            raise ConfigError(f"config file {path}: unknown table [{table}] (use [run])")
    values: dict[str, Any] = {}
    tables = ("run", "soak") if command == "soak" else ("run",)
    for table in tables:
        body = document.get(table, {})
        if not isinstance(body, dict):
            raise ConfigError(f"config file {path}: `{table}` must be a table, [{table}]")
        table_values = _read_table(path, table, body, command)
        _check_exclusive(table_values, f"config file {path} [{table}]")
        for name in table_values:
            for pair in _EXCLUSIVE:
                if name in pair:
                    for other in pair:
                        values.pop(other, None)
        values.update(table_values)
    return values


def _read_table(path: Path, table: str, body: dict[str, Any], command: Command) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, raw in body.items():
        option = _option_for_key(key)
        if option is None or not option.in_file:
            raise ConfigError(f"config file {path}: unknown key `{key}` in [{table}]")
        if command not in option.scopes:
            raise ConfigError(
                f"config file {path}: `{key}` in [{table}] applies only to "
                f"kvcanary {' / '.join(s for s in option.scopes if s != 'plugin')}"
            )
        try:
            values[option.name] = option.coerce(raw)
        except ValueError as exc:
            raise ConfigError(f"config file {path}: [{table}] {key}: {exc}") from None
    return values


def _option_for_key(key: str) -> Option | None:
    option = OPTIONS_BY_NAME.get(key.replace("-", "_"))
    # one spelling per key (the flag's), so two files never disagree on how to say it
    if option is None or option.key != key:
        return None
    return option


def _check_exclusive(values: Mapping[str, Any], where: str) -> None:
    for first, second in _EXCLUSIVE:
        if first in values and second in values:
            raise ConfigError(
                f"{where} gives both {first} and {second}; give one "
                f"(--{first.replace('_', '-')} or --{second.replace('_', '-')})"
            )

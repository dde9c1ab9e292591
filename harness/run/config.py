"""Run settings: the one precedence merge of every source, and the validated `RunConfig`.

Sources, lowest first: the defaults in `harness.run.options`; a TOML config file (its `[run]`
table, and for `kvcanary soak` its `[soak]` table over `[run]`); a scenario; the flags (the
command line; for the pytest plugin its ini file, then its command line). `merge` is the one
rule that combines them, for every command, the plugin, config files and scenarios: a later
layer's value replaces an earlier one; naming one side of an exclusive pair (`requests` /
`duration`, `concurrency` / `rate`) also drops the other side from every lower layer; one layer
naming both sides is a `ConfigError`. `layered` puts the sources in that order.

Unknown tables, unknown keys and bad values of a config file are `ConfigError`s that name the
file and the key. This module knows which combinations make sense (`--requests` with
`--duration` does not). It does not touch the network, the environment or the engine;
`harness.run.session` does.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.run.option_values import MAX_TENANTS
from kvcanary.harness.run.options import (
    OPTIONS_BY_NAME,
    Option,
    Scope,
    options_for,
)
from kvcanary.tenants.cost import CostBudget, Prices

Command = Literal["run", "soak"]

EXCLUSIVE: tuple[tuple[str, str], ...] = (("requests", "duration"), ("concurrency", "rate"))
"""Pairs of which one source may name only one side; a higher source naming either side
replaces the whole pair from lower sources (see `harness.run.config.merge`)."""

DEFAULT_NUM_REQUESTS = 60
DEFAULT_CONCURRENCY = 8
DEFAULT_ENGINE_CONCURRENCY = 1
"""The bundled engine is CPU-bound: one request at a time is as fast on a small machine,
and keeps its time-to-first-token clean enough for the timing detector."""


@dataclass(frozen=True, slots=True)
class Layer:
    """One source of settings: its name in messages, and the values it gives by option name."""

    source: str
    values: Mapping[str, Any]


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
    strict_page_size: bool = _default("strict_page_size")
    tokenizer: str = _default("tokenizer")
    api_key_env: str | None = _default("api_key_env")
    profile: str = _default("profile")
    seed: int | None = _default("seed")
    timeout: float = _default("timeout")
    health_timeout: float = _default("health_timeout")
    http_backend: Literal["aiohttp", "httpx"] = _default("http_backend")
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
    keep_journal: str | None = _default("keep_journal")
    force: bool = _default("force")
    ray: str | None = _default("ray")
    max_requests: int | None = _default("max_requests")
    max_prompt_tokens: int | None = _default("max_prompt_tokens")
    price_per_mtok: tuple[float, float] | None = _default("price_per_mtok")
    max_cost: float | None = _default("max_cost")
    yes: bool = _default("yes")
    keyring: str | None = _default("keyring")
    metrics_port: int | None = _default("metrics_port")

    def __post_init__(self) -> None:
        if self.requests is not None and self.duration is not None:
            raise ConfigError("give --requests or --duration, not both")
        if self.concurrency is not None and self.rate is not None:
            raise ConfigError("give --concurrency (closed loop) or --rate (open loop), not both")
        if self.command == "soak" and self.duration is None:
            raise ConfigError("kvcanary soak needs --duration (e.g. --duration 8h)")
        if self.tenants < 2:
            raise ConfigError("--tenants must be at least 2: a cross-tenant leak needs two")
        if self.tenants > MAX_TENANTS:
            raise ConfigError(f"--tenants must be at most {MAX_TENANTS}, got {self.tenants}")
        if self.target is not None and (
            self.engine_fix
            or self.engine_preset != _default("engine_preset")
            or self.engine_prefix_cache
        ):
            raise ConfigError(
                "--engine-preset/--engine-fix/--engine-prefix-cache apply only without --target"
            )
        self.cost_budget  # noqa: B018 (its own checks: --max-cost needs prices)
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

    @property
    def cost_budget(self) -> CostBudget:
        """The cost guard's limits (`tenants.cost`); inactive when none was given."""
        prices = None if self.price_per_mtok is None else Prices(*self.price_per_mtok)
        return CostBudget(self.max_requests, self.max_prompt_tokens, self.max_cost, prices)

    def to_record(self) -> dict[str, Any]:
        """The settings as journaled in `run_started` (no credential values exist here)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_values(cls, command: Command, values: Mapping[str, Any]) -> RunConfig:
        """The config `values` make: settings that are no field (`config`, `suite`) are
        dropped, as they are the caller's business."""
        names = {f.name for f in fields(cls)}
        return cls(**{"command": command, **{k: v for k, v in values.items() if k in names}})


def coerce_values(raw: Mapping[str, Any], where: Callable[[Option, Any], str]) -> dict[str, Any]:
    """Parsed values of one source, keyed by option name; a bad one is a `ConfigError` that
    starts with `where(option, raw_value)`: the source's own name for the setting."""
    values: dict[str, Any] = {}
    for name, value in raw.items():
        option = OPTIONS_BY_NAME[name]
        try:
            values[name] = option.coerce(value)
        except ValueError as exc:
            raise ConfigError(f"{where(option, value)}: {exc}") from None
    return values


def merge(*layers: Layer) -> dict[str, Any]:
    """The values the layers give, each layer over the ones before it (see the module doc).

    A value of None is given, as "unset": `kvcanary_run(requests=None)` drops a lower layer's
    `requests` (and `duration`) and leaves the default.
    """
    values: dict[str, Any] = {}
    for layer in layers:
        _check_exclusive(layer)
        for name in layer.values:
            for pair in EXCLUSIVE:
                if name in pair:
                    for other in pair:
                        values.pop(other, None)
        values.update(layer.values)
    return values


def layered(
    command: Command,
    *flags: Layer,
    config_path: str | Path | None = None,
    scenario: Layer | None = None,
) -> dict[str, Any]:
    """The settings every source gives, in the one order: config file < scenario < flags
    (`flags` lowest first). Defaults are not filled in: what is absent was not given."""
    layers = []
    if config_path is not None:
        file_values = load_config_file(config_path, command)
        layers.append(Layer(f"config file {config_path}", file_values))
    if scenario is not None:
        layers.append(scenario)
    return merge(*layers, *flags)


def settings(scope: Scope, *layers: Layer) -> dict[str, Any]:
    """Every option `scope` takes: the merged `layers` over the option's default there."""
    given = merge(*layers)
    return {option.name: given.get(option.name, option.default) for option in options_for(scope)}


def resolve(
    command: Command,
    flags: Mapping[str, Any],
    config_path: str | Path | None = None,
    *,
    scenario: Layer | None = None,
) -> RunConfig:
    """The run's settings: `flags` (the command line) over `scenario` over the file over
    defaults."""
    values = layered(
        command, Layer("the command line", flags), config_path=config_path, scenario=scenario
    )
    return RunConfig.from_values(command, values)


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
    except RecursionError:
        raise ConfigError(f"config file {path}: nested too deeply to be a config file") from None
    for table in document:
        if table not in ("run", "soak"):
            raise ConfigError(f"config file {path}: unknown table [{table}] (use [run])")
    layers = []
    for table in ("run", "soak") if command == "soak" else ("run",):
        body = document.get(table, {})
        if not isinstance(body, dict):
            raise ConfigError(f"config file {path}: `{table}` must be a table, [{table}]")
        layers.append(
            Layer(f"config file {path} [{table}]", _read_table(path, table, body, command))
        )
    return merge(*layers)


def _read_table(path: Path, table: str, body: dict[str, Any], command: Command) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for key, value in body.items():
        option = _option_for_key(key)
        if option is None or not option.in_file:
            raise ConfigError(f"config file {path}: unknown key `{key}` in [{table}]")
        if command not in option.scopes:
            if table == "run" and "run" in option.scopes:
                continue  # [run] is shared by run and soak: a run-only key is for `run`
            raise ConfigError(
                f"config file {path}: `{key}` in [{table}] applies only to {_takers(option)}"
            )
        raw[option.name] = value
    return coerce_values(raw, lambda option, _: f"config file {path}: [{table}] {option.key}")


def _option_for_key(key: str) -> Option | None:
    option = OPTIONS_BY_NAME.get(key.replace("-", "_"))
    # one spelling per key (the flag's), so two files never disagree on how to say it
    if option is None or option.key != key:
        return None
    return option


def _takers(option: Option) -> str:
    """`kvcanary soak`, `kvcanary run / audit`, or the plugin: who takes `option`."""
    commands = [scope for scope in option.scopes if scope != "plugin"]
    return f"kvcanary {' / '.join(commands)}" if commands else "the pytest plugin"


def _check_exclusive(layer: Layer) -> None:
    for first, second in EXCLUSIVE:
        if layer.values.get(first) is not None and layer.values.get(second) is not None:
            raise ConfigError(
                f"{layer.source} gives both {first} and {second}; give one "
                f"(--{first.replace('_', '-')} or --{second.replace('_', '-')})"
            )

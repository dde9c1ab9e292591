"""Scenario files: a reproduction written down as TOML, loaded and validated into a `Scenario`.

A scenario names an incident (name, description, upstream references), where to run it (a
target URL, or the bundled engine's preset, fixes and config overrides), the limits to size
against (given or discovered), the tenants, an ordered list of steps and the expected
outcome. Steps are `victims`, `probes` and `disconnect` (each sends `count` requests whose
sizes are expressions over the limits, see `tenants.size`) and `wait`. The expected outcome
is `leak` (with finding kinds that must / must not appear) or `clean`.

A `cache_probe` step runs the cross-tenant prefix-cache timing probe (`harness.cache_probe.probe`),
whose findings are `shared_prefix_cache`; a scenario still needs one send step besides it.

Parameters: `[params]` declares names with defaults; `${name}` anywhere in a string value
is replaced by the parameter's value (a string that is exactly `${name}` takes the value's
type, so `pool_tokens = "${pool}"` can become an integer). `--param name=value` overrides a
default; the value is read as a TOML literal when it is one (`284928`, `0.5`, `true`) and
as text otherwise.

Every schema problem is a line `FILE:LINE: FIELD: problem`, and a file's problems are
reported together, in file order, in one `ConfigError` (one problem: that line alone; more:
`FILE: N problems` and then one line each). `tomllib` gives line numbers only for syntax
errors, so `harness.scenarios.fields` scans the source text for the line where each key (or
table header) was written; fields are named like `steps[2].sizes` with array items counted
from 1. The checks themselves are in `harness.scenarios.checker` and
`harness.scenarios.step_checker`.

What it deliberately does not know: how steps are executed (`harness.scenarios.repro`) or what the
bundled engine does with its overrides; it only checks override names and types against
`reference_engine.config.EngineConfig`, imported lazily and only when the file has an
`[engine]` table (the harness runs against remote targets without the engine installed).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.record.verdict import Verdict
from kvcanary.tenants.plan import Intent
from kvcanary.tenants.size import SizeSpec
from kvcanary.tenants.tenant import Tenant

Outcome = Literal[Verdict.LEAK, Verdict.CLEAN]
"""What a scenario expects: the two verdicts a reproduction can be judged against."""
SendKind = Literal["victims", "probes", "disconnect"]
ParamValue = str | int | float | bool
Path_ = tuple[str | int, ...]
"""A key path in the document: table and key names, and 0-based indexes into arrays."""

DISCOVER = "discover"
DEFAULT_NUM_TENANTS = 4
DEFAULT_MAX_TOKENS: Mapping[SendKind, int] = MappingProxyType(
    {"victims": 16, "probes": 64, "disconnect": 64}
)
"""Victims only need to be prefilled; probes must be long enough to quote stale canaries;
a disconnect must still be streaming when it drops."""
INTENTS: Mapping[SendKind, Intent] = MappingProxyType(
    {"victims": "victim", "probes": "probe", "disconnect": "abort"}
)

NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
PARAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
REFERENCE = re.compile(r"\$\{([^}]*)\}")
TOP_KEYS = (
    "name", "description", "references", "seed", "target", "params", "engine", "client",
    "limits", "tenants", "steps", "expect",
)  # fmt: skip
STEP_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "victims": ("kind", "name", "sizes", "count", "concurrency", "max_tokens", "tenants"),
        "probes": ("kind", "name", "sizes", "count", "concurrency", "max_tokens", "tenants"),
        "disconnect": (
            "kind", "name", "size", "count", "concurrency", "max_tokens", "tenants",
            "after_chunks", "after_seconds",
        ),
        "wait": ("kind", "name", "seconds"),
        "cache_probe": (
            "kind", "name", "trials", "prompt_tokens", "prefix_fraction", "salts", "tenants",
        ),
    }
)  # fmt: skip


# -- the loaded scenario ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Param:
    """A declared parameter: its default and what it means."""

    name: str
    default: ParamValue
    help: str = ""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The bundled engine to start when no target is given."""

    preset: str
    fixes: tuple[str, ...] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """EngineConfig fields (context_length, prefill_pool_tokens, free_order, ...)."""


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """How requests are sent (to `/v1/completions`, for exact prompt token counts)."""

    model: str | None = None
    """None: the first model the target lists at /v1/models."""
    tokenizer: str = "cl100k_base"
    timeout_s: float = 120.0


@dataclass(frozen=True, slots=True)
class LimitsSpec:
    """Limits given by the scenario; None means ask the target."""

    pool_tokens: int | None = None
    context_tokens: int | None = None
    page_size: int | None = None


@dataclass(frozen=True, slots=True)
class TenantsSpec:
    """The simulated tenants, and the variable holding each one's API key (by name)."""

    names: tuple[str, ...]
    api_key_env: Mapping[str, str | None] = field(default_factory=dict)

    def build(self, api_key_env: str | None = None) -> list[Tenant]:
        """The tenants; `api_key_env` (the command line's) replaces every tenant's variable."""
        return [
            Tenant(name=name, api_key_env=api_key_env or self.api_key_env.get(name))
            for name in self.names
        ]


@dataclass(frozen=True, slots=True)
class SendStep:
    """`count` requests of `sizes` (cycled) from `tenants` (cycled; empty: drawn at random)."""

    kind: SendKind
    name: str
    line: int
    sizes: tuple[SizeSpec, ...]
    count: int
    concurrency: int
    max_tokens: int
    tenants: tuple[str, ...] = ()
    after_chunks: int | None = None
    """disconnect: drop the stream after this many content chunks (0: after the headers)."""
    after_seconds: float | None = None
    """disconnect: drop the connection this long after sending, response begun or not."""

    @property
    def intent(self) -> Intent:
        return INTENTS[self.kind]


@dataclass(frozen=True, slots=True)
class WaitStep:
    """Send nothing for `seconds`."""

    name: str
    line: int
    seconds: float
    kind: Literal["wait"] = "wait"


@dataclass(frozen=True, slots=True)
class CacheProbeStep:
    """The cross-tenant prefix-cache timing probe (`harness.cache_probe.probe`) over `tenants`."""

    name: str
    line: int
    trials: int = 20
    """Timed trials per arm."""
    prompt_tokens: int | None = None
    """None: the probe's default (1,024 tokens), shortened to fit the target's limits."""
    prefix_fraction: float = 0.875
    salts: bool = False
    """Each tenant gets its own random cache_salt (adds the spoofed-salt arms)."""
    tenants: tuple[str, ...] = ()
    """Empty: every tenant."""
    kind: Literal["cache_probe"] = "cache_probe"


Step = SendStep | WaitStep | CacheProbeStep


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a reproduction must observe."""

    outcome: Outcome
    must_include: tuple[FindingKind, ...] = ()
    """leak: each of these kinds must be found at least once (none listed: any finding)."""
    must_not_include: tuple[FindingKind, ...] = ()
    """leak: none of these kinds may be found. A `clean` outcome forbids every kind."""

    def describe(self) -> str:
        if self.outcome == Verdict.CLEAN:
            return "clean (no finding of any kind)"
        text = str(Verdict.LEAK)
        if self.must_include:
            text += f" with {', '.join(self.must_include)}"
        if self.must_not_include:
            text += f"; never {', '.join(self.must_not_include)}"
        return text


@dataclass(frozen=True, slots=True)
class Scenario:
    """A validated scenario with its parameters substituted."""

    name: str
    description: str
    source: str
    """The file it was read from (error messages and the journal name it)."""
    steps: tuple[Step, ...]
    expect: Expectation
    references: tuple[str, ...] = ()
    params: tuple[Param, ...] = ()
    param_values: Mapping[str, ParamValue] = field(default_factory=dict)
    seed: int | None = None
    target: str | None = None
    engine: EngineSpec | None = None
    client: ClientSpec = field(default_factory=ClientSpec)
    limits: LimitsSpec = field(default_factory=LimitsSpec)
    tenants: TenantsSpec = field(
        default_factory=lambda: TenantsSpec(tuple(f"tenant-{i}" for i in range(4)))
    )

    @property
    def summary(self) -> str:
        """The description's first line."""
        return self.description.strip().splitlines()[0] if self.description.strip() else ""

    @property
    def send_steps(self) -> tuple[SendStep, ...]:
        return tuple(s for s in self.steps if isinstance(s, SendStep))

    @property
    def num_requests(self) -> int:
        return sum(step.count for step in self.send_steps)

    def where(self, step: Step, key: str) -> str:
        """`FILE:LINE: steps[N].KEY` for errors found when the step meets real limits."""
        return f"{self.source}:{step.line}: steps[{self.steps.index(step) + 1}].{key}"

    def to_record(self) -> dict[str, Any]:
        """What the journal's `run_started.settings` says about the scenario."""
        return {
            "command": "repro",
            "scenario": self.name,
            "scenario_source": self.source,
            "expected_outcome": self.expect.outcome,
            "expected_findings": ",".join(self.expect.must_include),
            "forbidden_findings": ",".join(self.expect.must_not_include),
            **{f"param.{name}": value for name, value in self.param_values.items()},
            "engine_preset": self.engine.preset if self.engine else None,
            "engine_fix": list(self.engine.fixes) if self.engine else None,
            "seed": self.seed,
        }


# -- loading ---------------------------------------------------------------------------


def load_scenario(path: str | Path, params: Mapping[str, str] | None = None) -> Scenario:
    """Read and validate the scenario file at `path`, with `params` overriding defaults."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"scenario file {path}: not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"scenario file {path}: cannot read it ({exc})") from None
    return parse_scenario(text, str(path), params)


def resolve_scenario(spec: str, params: Mapping[str, str] | None = None) -> Scenario:
    """A shipped scenario by name (`kvcanary scenarios` lists them), or a file by path."""
    from kvcanary.harness.scenarios import shipped_file, shipped_names

    shipped = None if "/" in spec or spec.endswith(".toml") else shipped_file(spec)
    if shipped is not None:
        return parse_scenario(shipped.read_text(encoding="utf-8"), str(shipped), params)
    if not Path(spec).is_file():
        raise ConfigError(
            f"no scenario {spec!r}: neither a shipped one ({', '.join(shipped_names())}) nor a file"
        )
    return load_scenario(spec, params)


def parse_scenario(
    text: str, source: str = "<scenario>", params: Mapping[str, str] | None = None
) -> Scenario:
    """Validate scenario TOML `text`; `source` names it in error messages."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = re.search(r"at line (\d+)", str(exc))
        where = f"{source}:{line.group(1)}" if line else source
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be a scenario") from None
    from kvcanary.harness.scenarios.checker import ScenarioChecker

    return ScenarioChecker(source, text).scenario(document, dict(params or {}))


def parse_param_assignment(text: str) -> tuple[str, str]:
    """`name=value` from the command line -> (name, value)."""
    name, sep, value = text.partition("=")
    if not sep or not PARAM_NAME.fullmatch(name.strip()):
        raise ConfigError(f"--param {text!r}: expected NAME=VALUE (e.g. pool_tokens=284928)")
    return name.strip(), value.strip()


def parse_param_value(raw: str) -> ParamValue:
    """A command-line value as a TOML literal where it is one, else as text."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if isinstance(value, str | int | float | bool):
        return value
    return raw

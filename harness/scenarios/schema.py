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

Every schema error is a `ConfigError` of one line, `FILE:LINE: FIELD: problem`. `tomllib`
gives line numbers only for syntax errors, so `_key_lines` scans the source text for the
line where each key (or table header) was written; fields are named like
`steps[2].sizes` with array items counted from 1.

What it deliberately does not know: how steps are executed (`harness.scenarios.repro`) or what the
bundled engine does with its overrides; it only checks override names and types against
`reference_engine.config.EngineConfig`, imported lazily and only when the file has an
`[engine]` table (the harness runs against remote targets without the engine installed).
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NoReturn

from canaries.errors import ConfigError
from harness.record.finding import FindingKind
from tenants.plan import Intent
from tenants.size import SizeSpec
from tenants.tenant import Tenant

Outcome = Literal["leak", "clean"]
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

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_PARAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOP_KEYS = (
    "name", "description", "references", "seed", "target", "params", "engine", "client",
    "limits", "tenants", "steps", "expect",
)  # fmt: skip
_STEP_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
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
        if self.outcome == "clean":
            return "clean (no finding of any kind)"
        text = "leak"
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
    from harness.scenarios import shipped_file, shipped_names

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
    return _Checker(source, text).scenario(document, dict(params or {}))


def parse_param_assignment(text: str) -> tuple[str, str]:
    """`name=value` from the command line -> (name, value)."""
    name, sep, value = text.partition("=")
    if not sep or not _PARAM_NAME.fullmatch(name.strip()):
        raise ConfigError(f"--param {text!r}: expected NAME=VALUE (e.g. pool_tokens=284928)")
    return name.strip(), value.strip()


def _parse_param_value(raw: str) -> ParamValue:
    """A command-line value as a TOML literal where it is one, else as text."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if isinstance(value, str | int | float | bool):
        return value
    return raw


# -- where each key was written ----------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'')
_BARE_OR_QUOTED = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_KEY = re.compile(rf"^\s*({_BARE_OR_QUOTED}(?:\s*\.\s*{_BARE_OR_QUOTED})*)\s*=")
_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_BARE_OR_QUOTED}(?:\s*\.\s*{_BARE_OR_QUOTED})*)\s*\]\]?")


def _split_key(key: str) -> tuple[str, ...]:
    parts = re.findall(_BARE_OR_QUOTED, key)
    return tuple(p[1:-1] if p[:1] in "\"'" else p for p in parts)


def _key_lines(text: str) -> dict[Path_, int]:
    """The 1-based line of each table header and key, by key path.

    A small scanner, not a parser (tomllib has already accepted the text): it skips
    multi-line strings and the inside of multi-line arrays and inline tables, so a line
    there that looks like `key = value` is never taken for a key.
    """
    lines: dict[Path_, int] = {}
    table: Path_ = ()
    arrays: dict[tuple[str, ...], int] = {}
    depth = 0
    quote: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if quote is not None:  # inside a multi-line string
            if quote in line:
                quote = None
            continue
        if depth == 0:
            header = _HEADER.match(line)
            if header:
                names = _split_key(header.group(2))
                if header.group(1) == "[[":
                    arrays[names] = arrays.get(names, -1) + 1
                    table = (*names, arrays[names])
                else:
                    table = names
                lines.setdefault(table, number)
                continue
            key = _KEY.match(line)
            if key:
                lines.setdefault((*table, *_split_key(key.group(1))), number)
        code = _code(line)
        for opener in ('"""', "'''"):
            if code.count(opener) % 2 == 1:  # a multi-line string starts here
                quote = opener
                code = code[: code.index(opener)]
        code = _STRING.sub('""', code)
        depth += code.count("[") + code.count("{") - code.count("]") - code.count("}")
        depth = max(depth, 0)
    return lines


def _code(line: str) -> str:
    """`line` without its comment (a `#` inside a string is not a comment)."""
    out, pos = [], 0
    for match in _STRING.finditer(line):
        before = line[pos : match.start()]
        if "#" in before:
            out.append(before.split("#", 1)[0])
            return "".join(out)
        out.append(before + match.group(0))
        pos = match.end()
    return "".join(out) + line[pos:].split("#", 1)[0]


# -- validation ------------------------------------------------------------------------


class _Checker:
    """Validates a parsed document; every error names the file, the line and the field."""

    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.lines = _key_lines(text)

    def line_of(self, path: Path_) -> int:
        """The line of `path`, or of its nearest enclosing key or table; 1 if none."""
        for end in range(len(path), 0, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return 1

    def fail(self, path: Path_, message: str) -> NoReturn:
        raise ConfigError(f"{self.source}:{self.line_of(path)}: {_field(path)}: {message}")

    # -- the document --------------------------------------------------------------

    def scenario(self, doc: dict[str, Any], overrides: dict[str, str]) -> Scenario:
        self.keys((), doc, _TOP_KEYS)
        params = self.params(doc.get("params", {}))
        values = self.param_values(params, overrides)
        doc = {
            k: (v if k == "params" else self.substitute((k,), v, values)) for k, v in doc.items()
        }
        for required in ("name", "description", "steps"):
            if required not in doc:
                self.fail((required,), "missing (every scenario needs name, description, steps)")
        if "expect" not in doc:
            self.fail(("expect",), 'missing: say what must happen, [expect] outcome = "leak"')
        name = self.string(("name",), doc["name"])
        if not _NAME.fullmatch(name):
            self.fail(("name",), f"{name!r}: use lowercase letters, digits, '.', '_', '-'")
        if "target" in doc and "engine" in doc:
            self.fail(("engine",), "give `target` or an [engine] table, not both")
        tenants = self.tenants(doc.get("tenants", {}))
        steps = self.steps(doc["steps"], tenants.names)
        return Scenario(
            name=name,
            description=self.string(("description",), doc["description"]),
            source=self.source,
            steps=steps,
            expect=self.expect(doc["expect"]),
            references=self.strings(("references",), doc.get("references", [])),
            params=params,
            param_values=MappingProxyType(values),
            seed=self.integer(("seed",), doc["seed"], 0) if "seed" in doc else None,
            target=self.url(("target",), doc["target"]) if "target" in doc else None,
            engine=self.engine(doc["engine"]) if "engine" in doc else None,
            client=self.client(doc.get("client", {})),
            limits=self.limits(doc.get("limits", {})),
            tenants=tenants,
        )

    def params(self, raw: Any) -> tuple[Param, ...]:
        path: Path_ = ("params",)
        params = []
        for name, value in self.table(path, raw).items():
            if not _PARAM_NAME.fullmatch(name):
                self.fail((*path, name), "a parameter name is letters, digits and '_'")
            if isinstance(value, dict):
                self.keys((*path, name), value, ("default", "help"))
                if "default" not in value:
                    self.fail((*path, name), "missing `default`")
                default, help_text = value["default"], value.get("help", "")
                help_text = self.string((*path, name, "help"), help_text, empty=True)
            else:
                default, help_text = value, ""
            if not isinstance(default, str | int | float | bool):
                self.fail((*path, name), "a default is a string, number or boolean")
            params.append(Param(name, default, help_text))
        return tuple(params)

    def param_values(
        self, params: Sequence[Param], overrides: Mapping[str, str]
    ) -> dict[str, ParamValue]:
        values: dict[str, ParamValue] = {p.name: p.default for p in params}
        declared = {p.name: p for p in params}
        for name, raw in overrides.items():
            param = declared.get(name)
            if param is None:
                known = ", ".join(declared) or "none"
                raise ConfigError(
                    f"--param {name}: {self.source} declares no such parameter (it has: {known})"
                )
            values[name] = _coerce_param(param, raw)
        return values

    def substitute(self, path: Path_, value: Any, values: Mapping[str, ParamValue]) -> Any:
        """`value` with every `${name}` replaced (recursively through tables and arrays)."""
        if isinstance(value, dict):
            return {k: self.substitute((*path, k), v, values) for k, v in value.items()}
        if isinstance(value, list):
            return [self.substitute((*path, i), v, values) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        for match in _REFERENCE.finditer(value):
            if match.group(1) not in values:
                self.fail(path, f"${{{match.group(1)}}} is not a declared parameter ([params])")
        whole = _REFERENCE.fullmatch(value)
        if whole:
            return values[whole.group(1)]
        return _REFERENCE.sub(lambda m: _text(values[m.group(1)]), value)

    def engine(self, raw: Any) -> EngineSpec:
        path: Path_ = ("engine",)
        body = self.table(path, raw)
        preset = self.string((*path, "preset"), body.get("preset", "vulnerable"))
        fixes = self.strings((*path, "fixes"), body.get("fixes", []))
        overrides = {k: v for k, v in body.items() if k not in ("preset", "fixes")}
        self.engine_config(preset, fixes, overrides)
        return EngineSpec(preset, fixes, MappingProxyType(overrides))

    def engine_config(self, preset: str, fixes: tuple[str, ...], overrides: dict[str, Any]) -> None:
        """Check names and types against EngineConfig, then build it (no torch needed)."""
        try:
            from reference_engine.config import FIXES, PRESETS, EngineConfig
        except ImportError:  # the engine is not installed: it is checked when started
            return
        import dataclasses

        path: Path_ = ("engine",)
        if preset not in PRESETS:
            self.fail((*path, "preset"), f"{preset!r}: choose one of {', '.join(PRESETS)}")
        for i, fix in enumerate(fixes):
            if fix not in FIXES:
                self.fail((*path, "fixes", i), f"unknown fix {fix!r}; known: {', '.join(FIXES)}")
        types = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
        for key, value in overrides.items():
            kind = types.get(key)
            if kind is None or key == "preset":
                self.fail((*path, key), "not an engine setting (see `kvcanary serve --help`)")
            if not _matches(kind, value):
                self.fail((*path, key), f"expected {kind}, got {value!r}")
        try:
            config = EngineConfig.from_preset(preset, **overrides)
            if set(fixes) - config.fixes:
                EngineConfig.from_preset(
                    preset, **{**overrides, "fixes": config.fixes | set(fixes)}
                )
        except (TypeError, ValueError) as exc:
            named = [k for k in overrides if k in str(exc)]
            self.fail((*path, named[0]) if named else path, str(exc))

    def client(self, raw: Any) -> ClientSpec:
        path: Path_ = ("client",)
        body = self.table(path, raw)
        self.keys(path, body, ("model", "tokenizer", "timeout_s"))
        model = self.string((*path, "model"), body.get("model", DISCOVER))
        timeout = self.number((*path, "timeout_s"), body.get("timeout_s", 120.0))
        return ClientSpec(
            model=None if model == DISCOVER else model,
            tokenizer=self.string((*path, "tokenizer"), body.get("tokenizer", "cl100k_base")),
            timeout_s=timeout,
        )

    def limits(self, raw: Any) -> LimitsSpec:
        path: Path_ = ("limits",)
        body = self.table(path, raw)
        self.keys(path, body, ("pool_tokens", "context_tokens", "page_size"))
        found = {key: self.limit((*path, key), body.get(key, DISCOVER)) for key in body}
        return LimitsSpec(**found)

    def limit(self, path: Path_, value: Any) -> int | None:
        if value == DISCOVER:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.fail(path, f'expected a positive number of tokens or "{DISCOVER}", got {value!r}')
        return value

    def tenants(self, raw: Any) -> TenantsSpec:
        path: Path_ = ("tenants",)
        body = self.table(path, raw)
        self.keys(path, body, ("count", "names", "api_key_env"))
        if "count" in body and "names" in body:
            self.fail(path, "give `count` or `names`, not both")
        if "names" in body:
            names = self.strings((*path, "names"), body["names"])
            if len(set(names)) != len(names):
                self.fail((*path, "names"), "tenant names must be unique")
        else:
            count = self.integer((*path, "count"), body.get("count", DEFAULT_NUM_TENANTS), 2)
            names = tuple(f"tenant-{i}" for i in range(count))
        if len(names) < 2:
            self.fail(path, "a cross-tenant leak needs at least two tenants")
        keys = self.api_key_env((*path, "api_key_env"), body.get("api_key_env"), names)
        try:
            for name in names:
                Tenant(name=name, api_key_env=keys.get(name))
        except ConfigError as exc:
            self.fail(path, str(exc))
        return TenantsSpec(names, MappingProxyType(keys))

    def api_key_env(self, path: Path_, raw: Any, names: tuple[str, ...]) -> dict[str, str | None]:
        if raw is None:
            return {}
        if isinstance(raw, str):
            raw = dict.fromkeys(names, raw)
        body = self.table(path, raw)
        for name, variable in body.items():
            if name not in names:
                self.fail((*path, name), f"no tenant named {name!r}")
            if not isinstance(variable, str) or not _ENV_NAME.fullmatch(variable):
                self.fail((*path, name), "expected the NAME of an environment variable")
        return dict(body)

    def steps(self, raw: Any, tenants: tuple[str, ...]) -> tuple[Step, ...]:
        if not isinstance(raw, list) or not raw:
            self.fail(("steps",), "expected one or more [[steps]] tables")
        steps = tuple(self.step(("steps", i), body, tenants) for i, body in enumerate(raw))
        if not any(isinstance(s, SendStep) for s in steps):
            self.fail(("steps",), "no step sends anything (victims, probes or disconnect)")
        names = [s.name for s in steps]
        for i, name in enumerate(names):
            if names.index(name) != i:
                self.fail(("steps", i, "name"), f"two steps are named {name!r}")
        return steps

    def step(self, path: Path_, raw: Any, tenants: tuple[str, ...]) -> Step:
        body = self.table(path, raw)
        if "kind" not in body:
            self.fail(path, "missing `kind` (victims, probes, disconnect or wait)")
        kind = self.string((*path, "kind"), body["kind"])
        if kind not in _STEP_KEYS:
            self.fail(
                (*path, "kind"),
                f"{kind!r}: expected victims, probes, disconnect, wait or cache_probe",
            )
        self.keys(path, body, _STEP_KEYS[kind])
        assert isinstance(path[1], int)
        name = self.string((*path, "name"), body.get("name", f"{path[1] + 1}-{kind}"))
        line = self.line_of(path)
        if kind == "wait":
            if "seconds" not in body:
                self.fail(path, "missing `seconds`")
            return WaitStep(name, line, self.number((*path, "seconds"), body["seconds"]))
        if kind == "cache_probe":
            return self.cache_probe(path, body, name, line, tenants)
        send_kind: SendKind = (
            "victims" if kind == "victims" else ("probes" if kind == "probes" else "disconnect")
        )
        sizes = self.sizes(path, body, send_kind)
        after_chunks = after_seconds = None
        if send_kind == "disconnect":
            if ("after_chunks" in body) == ("after_seconds" in body):
                self.fail(path, "a disconnect needs `after_chunks` or `after_seconds` (one)")
            if "after_chunks" in body:
                after_chunks = self.integer((*path, "after_chunks"), body["after_chunks"], 0)
            else:
                after_seconds = self.number((*path, "after_seconds"), body["after_seconds"])
        step_tenants = self.strings((*path, "tenants"), body.get("tenants", []))
        for i, tenant in enumerate(step_tenants):
            if tenant not in tenants:
                self.fail((*path, "tenants", i), f"no tenant named {tenant!r} (see [tenants])")
        return SendStep(
            kind=send_kind,
            name=name,
            line=line,
            sizes=sizes,
            count=self.integer((*path, "count"), body.get("count", len(sizes)), 1),
            concurrency=self.integer((*path, "concurrency"), body.get("concurrency", 1), 1),
            max_tokens=self.integer(
                (*path, "max_tokens"), body.get("max_tokens", DEFAULT_MAX_TOKENS[send_kind]), 1
            ),
            tenants=step_tenants,
            after_chunks=after_chunks,
            after_seconds=after_seconds,
        )

    def cache_probe(
        self, path: Path_, body: dict[str, Any], name: str, line: int, tenants: tuple[str, ...]
    ) -> CacheProbeStep:
        prompt_tokens = body.get("prompt_tokens")
        fraction = body.get("prefix_fraction", 0.875)
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            self.fail((*path, "prefix_fraction"), f"expected a number, got {fraction!r}")
        if not 0 < fraction < 1:
            self.fail((*path, "prefix_fraction"), f"must be between 0 and 1, got {fraction}")
        salts = body.get("salts", False)
        if not isinstance(salts, bool):
            self.fail((*path, "salts"), f"expected true or false, got {salts!r}")
        step_tenants = self.strings((*path, "tenants"), body.get("tenants", []))
        for i, tenant in enumerate(step_tenants):
            if tenant not in tenants:
                self.fail((*path, "tenants", i), f"no tenant named {tenant!r} (see [tenants])")
        if step_tenants and len(set(step_tenants)) < 2:
            self.fail((*path, "tenants"), "the probe needs at least two distinct tenants")
        return CacheProbeStep(
            name=name,
            line=line,
            trials=self.integer((*path, "trials"), body.get("trials", 20), 5),
            prompt_tokens=(
                None
                if prompt_tokens is None
                else self.integer((*path, "prompt_tokens"), prompt_tokens, 2)
            ),
            prefix_fraction=float(fraction),
            salts=salts,
            tenants=step_tenants,
        )

    def sizes(self, path: Path_, body: dict[str, Any], kind: SendKind) -> tuple[SizeSpec, ...]:
        key = "size" if kind == "disconnect" else "sizes"
        if key not in body:
            self.fail(path, f'missing `{key}` (size expressions such as "pool+1")')
        raw = [body[key]] if key == "size" else body[key]
        if not isinstance(raw, list) or not raw:
            self.fail((*path, key), "expected a list of one or more size expressions")
        specs = []
        for i, expr in enumerate(raw):
            where: Path_ = (*path, key) if key == "size" else (*path, key, i)
            if isinstance(expr, bool) or not isinstance(expr, str | int | float):
                self.fail(where, f'expected a size expression such as "pool+1", got {expr!r}')
            text = str(expr)
            try:
                specs.append(SizeSpec(text.replace(" ", ""), text, INTENTS[kind]))
            except ConfigError as exc:
                self.fail(where, str(exc))
        return tuple(specs)

    def expect(self, raw: Any) -> Expectation:
        path: Path_ = ("expect",)
        body = self.table(path, raw)
        self.keys(path, body, ("outcome", "must_include", "must_not_include"))
        if "outcome" not in body:
            self.fail(path, 'missing `outcome` ("leak" or "clean")')
        outcome = self.string((*path, "outcome"), body["outcome"])
        if outcome not in ("leak", "clean"):
            self.fail((*path, "outcome"), f'{outcome!r}: expected "leak" or "clean"')
        include = self.kinds((*path, "must_include"), body.get("must_include", []))
        exclude = self.kinds((*path, "must_not_include"), body.get("must_not_include", []))
        if outcome == "clean" and (include or exclude):
            key = "must_include" if include else "must_not_include"
            self.fail((*path, key), "a clean outcome allows no finding at all; remove this list")
        both = set(include) & set(exclude)
        if both:
            self.fail((*path, "must_not_include"), f"{', '.join(sorted(both))} is also required")
        return Expectation("leak" if outcome == "leak" else "clean", include, exclude)

    def kinds(self, path: Path_, raw: Any) -> tuple[FindingKind, ...]:
        names = self.strings(path, raw)
        known = {str(kind) for kind in FindingKind}
        for i, name in enumerate(names):
            if name not in known:
                self.fail((*path, i), f"unknown finding kind {name!r}; known: {', '.join(known)}")
        return tuple(FindingKind(name) for name in names)

    # -- typed values --------------------------------------------------------------

    def keys(self, path: Path_, body: Mapping[str, Any], allowed: Sequence[str]) -> None:
        for key in body:
            if key not in allowed:
                self.fail((*path, key), f"unknown key (expected one of: {', '.join(allowed)})")

    def table(self, path: Path_, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict):
            self.fail(path, f"expected a table, got {_kind(raw)}")
        return raw

    def string(self, path: Path_, raw: Any, *, empty: bool = False) -> str:
        if not isinstance(raw, str):
            self.fail(path, f"expected a string, got {_kind(raw)} {raw!r}")
        if not empty and not raw.strip():
            self.fail(path, "must not be empty")
        return raw

    def strings(self, path: Path_, raw: Any) -> tuple[str, ...]:
        if not isinstance(raw, list):
            self.fail(path, f"expected a list of strings, got {_kind(raw)}")
        return tuple(self.string((*path, i), item) for i, item in enumerate(raw))

    def integer(self, path: Path_, raw: Any, minimum: int) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            self.fail(path, f"expected an integer, got {_kind(raw)} {raw!r}")
        if raw < minimum:
            self.fail(path, f"must be at least {minimum}, got {raw}")
        return raw

    def number(self, path: Path_, raw: Any) -> float:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            self.fail(path, f"expected a number of seconds, got {_kind(raw)} {raw!r}")
        if not (math.isfinite(raw) and raw > 0):
            self.fail(path, f"must be a positive number, got {raw}")
        return float(raw)

    def url(self, path: Path_, raw: Any) -> str:
        text = self.string(path, raw)
        if not re.match(r"^https?://[^/\s]+", text):
            self.fail(path, f"expected an http(s) URL, got {text!r}")
        return text.rstrip("/")


def _coerce_param(param: Param, raw: str) -> ParamValue:
    """A command-line value for `param`: the default's type where that is a number or bool."""
    value = _parse_param_value(raw)
    default = param.default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"--param {param.name}={raw}: expected true or false")
    elif isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"--param {param.name}={raw}: expected an integer (default {default})"
            )
    elif isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"--param {param.name}={raw}: expected a number (default {default})")
        value = float(value)
    return value  # a text default takes any value; numbers stay numbers


def _matches(kind: str, value: Any) -> bool:
    """Whether a TOML value fits an EngineConfig field annotation."""
    if isinstance(value, bool):
        return kind == "bool"
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, int | float)
    if kind == "str":
        return isinstance(value, str)
    if kind.startswith("frozenset"):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return True


def _text(value: ParamValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _kind(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def _field(path: Path_) -> str:
    """`steps[2].sizes[1]`: array items counted from 1, as a person counts them."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part + 1}]"
        else:
            text += f".{part}" if text else part
    return text or "(file)"

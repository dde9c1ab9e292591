"""The scenario-specific half of validation: each table of a scenario file checked and built
into the `harness.scenarios.schema` dataclasses.

Checking goes on past a problem: each table, step, item and key is its own part
(`Fields.attempt`), so one `ConfigError` lists every problem of the file in file order. A
part whose check failed yields a stand-in value that never leaves this module (the file is
refused), and checks that would only repeat a noted problem are skipped (a step's tenants
are not checked against a `[tenants]` table that was itself wrong).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any, TypeVar

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.record.verdict import Verdict
from kvcanary.harness.scenarios.fields import Invalid, coerce_param, matches, param_text
from kvcanary.harness.scenarios.schema import (
    DEFAULT_NUM_TENANTS,
    DISCOVER,
    NAME,
    PARAM_NAME,
    REFERENCE,
    TOP_KEYS,
    ClientSpec,
    EngineSpec,
    Expectation,
    LimitsSpec,
    Param,
    ParamValue,
    Path_,
    Scenario,
    TenantsSpec,
)
from kvcanary.harness.scenarios.step_checker import StepChecker
from kvcanary.tenants.tenant import Tenant, env_name_problem

_T = TypeVar("_T")
_F = TypeVar("_F")
_UNKNOWN_TENANTS = None
"""The tenants, when `[tenants]` itself has a problem: step tenants are then not checked."""


_OUTCOMES = f'"{Verdict.LEAK}" or "{Verdict.CLEAN}"'


class ScenarioChecker(StepChecker):
    """Validates a parsed scenario document into a `Scenario`."""

    def __init__(self, source: str, text: str) -> None:
        super().__init__(source, text)
        self.broken_params: set[str] = set()
        """Parameters declared wrongly: that is reported, their uses are not."""

    def scenario(self, doc: dict[str, Any], overrides: dict[str, str]) -> Scenario:
        """The scenario, or one `ConfigError` naming every problem of the file."""
        return self.checked(partial(self._scenario, doc, overrides))

    def _scenario(self, doc: dict[str, Any], overrides: dict[str, str]) -> Scenario:
        self.keys((), doc, TOP_KEYS)
        params = self.attempt(partial(self.params, doc.get("params", {})), ())
        values = self.param_values(params, overrides)
        doc = {
            k: (v if k == "params" else self.substitute((k,), v, values)) for k, v in doc.items()
        }
        for required in ("name", "description", "steps"):
            if required not in doc:
                self.note((required,), "missing (every scenario needs name, description, steps)")
        if "expect" not in doc:
            self.note(("expect",), 'missing: say what must happen, [expect] outcome = "leak"')
        if "target" in doc and "engine" in doc:
            self.note(("engine",), "give `target` or an [engine] table, not both")
        tenants = self.attempt(partial(self.tenants, doc.get("tenants", {})), _UNKNOWN_TENANTS)
        names = tenants.names if tenants is not None else None
        steps = self.attempt(partial(self.steps, doc.get("steps"), names), ())
        return Scenario(
            name=self.part(doc, "name", self.name, ""),
            description=self.part(doc, "description", partial(self.string, ("description",)), ""),
            source=self.source,
            steps=steps,
            expect=self.part(doc, "expect", self.expect, Expectation(Verdict.CLEAN)),
            references=self.attempt(
                partial(self.strings, ("references",), doc.get("references", [])), ()
            ),
            params=params,
            param_values=MappingProxyType(values),
            seed=self.part(doc, "seed", partial(self.integer, ("seed",), minimum=0), None),
            target=self.part(doc, "target", partial(self.url, ("target",)), None),
            engine=self.part(doc, "engine", self.engine, None),
            client=self.attempt(partial(self.client, doc.get("client", {})), ClientSpec()),
            limits=self.attempt(partial(self.limits, doc.get("limits", {})), LimitsSpec()),
            tenants=tenants if tenants is not None else TenantsSpec(()),
        )

    def part(
        self, doc: Mapping[str, Any], key: str, read: Callable[[Any], _T], fallback: _F
    ) -> _T | _F:
        """`read(doc[key])` where the key is given and reads well; else `fallback`."""
        if key not in doc:
            return fallback
        return self.attempt(partial(read, doc[key]), fallback)

    def name(self, raw: Any) -> str:
        name = self.string(("name",), raw)
        if not NAME.fullmatch(name):
            self.fail(("name",), f"{name!r}: use lowercase letters, digits, '.', '_', '-'")
        return name

    def params(self, raw: Any) -> tuple[Param, ...]:
        params = self.table(("params",), raw).items()
        found = [self.attempt(partial(self.param, name, value), None) for name, value in params]
        return tuple(param for param in found if param is not None)

    def param(self, name: str, value: Any) -> Param:
        path: Path_ = ("params", name)
        try:
            if not PARAM_NAME.fullmatch(name):
                self.fail(path, "a parameter name is letters, digits and '_'")
            if isinstance(value, dict):
                self.keys(path, value, ("default", "help"))
                if "default" not in value:
                    self.fail(path, "missing `default`")
                default, help_text = value["default"], value.get("help", "")
                help_text = self.string((*path, "help"), help_text, empty=True)
            else:
                default, help_text = value, ""
            if not isinstance(default, str | int | float | bool):
                self.fail(path, "a default is a string, number or boolean")
        except Invalid:
            self.broken_params.add(name)
            raise
        return Param(name, default, help_text)

    def param_values(
        self, params: Sequence[Param], overrides: Mapping[str, str]
    ) -> dict[str, ParamValue]:
        values: dict[str, ParamValue] = {p.name: p.default for p in params}
        declared = {p.name: p for p in params}
        for name, raw in overrides.items():
            param = declared.get(name)
            if param is None:
                if name in self.broken_params:
                    continue  # declared, wrongly: that problem is reported
                known = ", ".join(declared) or "none"
                raise ConfigError(
                    f"--param {name}: {self.source} declares no such parameter (it has: {known})"
                )
            values[name] = coerce_param(param, raw)
        return values

    def substitute(self, path: Path_, value: Any, values: Mapping[str, ParamValue]) -> Any:
        """`value` with every `${name}` replaced (recursively through tables and arrays); a
        reference to no declared parameter is noted, and the value marked broken."""
        if isinstance(value, dict):
            return {k: self.substitute((*path, k), v, values) for k, v in value.items()}
        if isinstance(value, list):
            return [self.substitute((*path, i), v, values) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        for match in REFERENCE.finditer(value):
            if match.group(1) not in values:
                if match.group(1) not in self.broken_params:
                    self.note(path, f"${{{match.group(1)}}} is not a declared parameter ([params])")
                self.broken.add(path)
                return value
        whole = REFERENCE.fullmatch(value)
        if whole:
            return values[whole.group(1)]
        return REFERENCE.sub(lambda m: param_text(values[m.group(1)]), value)

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
            from kvcanary.reference_engine.config import FIXES, PRESETS, EngineConfig
        except ImportError:  # the engine is not installed: it is checked when started
            return
        import dataclasses

        path: Path_ = ("engine",)
        found = len(self.problems)
        if preset not in PRESETS:
            self.note((*path, "preset"), f"{preset!r}: choose one of {', '.join(PRESETS)}")
        for i, fix in enumerate(fixes):
            if fix not in FIXES:
                self.note((*path, "fixes", i), f"unknown fix {fix!r}; known: {', '.join(FIXES)}")
        types = {f.name: str(f.type) for f in dataclasses.fields(EngineConfig)}
        for key, value in overrides.items():
            kind = types.get(key)
            if kind is None or key == "preset":
                self.note((*path, key), "not an engine setting (see `kvcanary serve --help`)")
            elif not matches(kind, value):
                self.note((*path, key), f"expected {kind}, got {value!r}")
        if len(self.problems) > found:
            raise Invalid("engine")  # a configuration of wrong names says nothing more
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
        read = partial(self.read, path, body)
        model = read("model", self.string, DISCOVER)
        return ClientSpec(
            model=None if model == DISCOVER else model,
            tokenizer=read("tokenizer", self.string, "cl100k_base"),
            timeout_s=read("timeout_s", self.number, 120.0),
        )

    def limits(self, raw: Any) -> LimitsSpec:
        path: Path_ = ("limits",)
        body = self.table(path, raw)
        self.keys(path, body, ("pool_tokens", "context_tokens", "page_size"))
        found = {
            key: self.attempt(partial(self.limit, (*path, key), body[key]), None)
            for key in body
            if key in ("pool_tokens", "context_tokens", "page_size")
        }
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
        found = len(self.problems)
        for name, variable in body.items():
            if name not in names:
                self.note((*path, name), f"no tenant named {name!r}")
            elif not isinstance(variable, str):
                self.note((*path, name), "expected the NAME of an environment variable")
            elif (problem := env_name_problem(variable)) is not None:
                self.note((*path, name), problem)
        if len(self.problems) > found:
            raise Invalid("api_key_env")
        return dict(body)

    def expect(self, raw: Any) -> Expectation:
        path: Path_ = ("expect",)
        body = self.table(path, raw)
        self.keys(path, body, ("outcome", "must_include", "must_not_include"))
        if "outcome" not in body:
            self.fail(path, f"missing `outcome` ({_OUTCOMES})")
        outcome = self.string((*path, "outcome"), body["outcome"])
        if outcome not in (Verdict.LEAK, Verdict.CLEAN):
            self.fail((*path, "outcome"), f"{outcome!r}: expected {_OUTCOMES}")
        include = self.read(path, body, "must_include", self.kinds, ())
        exclude = self.read(path, body, "must_not_include", self.kinds, ())
        if outcome == Verdict.CLEAN and (include or exclude):
            key = "must_include" if include else "must_not_include"
            self.fail((*path, key), "a clean outcome allows no finding at all; remove this list")
        both = set(include) & set(exclude)
        if both:
            self.fail((*path, "must_not_include"), f"{', '.join(sorted(both))} is also required")
        if outcome == Verdict.LEAK:
            return Expectation(Verdict.LEAK, include, exclude)
        return Expectation(Verdict.CLEAN, include, exclude)

    def kinds(self, path: Path_, raw: Any) -> tuple[FindingKind, ...]:
        names = self.strings(path, raw)
        known = [str(kind) for kind in FindingKind]
        for i, name in enumerate(names):
            if name not in known:
                self.note((*path, i), f"unknown finding kind {name!r}; known: {', '.join(known)}")
        return tuple(FindingKind(name) for name in names if name in known)

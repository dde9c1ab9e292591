"""The scenario-specific half of validation: each table of a scenario file checked and built
into the `harness.scenarios.schema` dataclasses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.scenarios.fields import Fields, coerce_param, matches, param_text
from kvcanary.harness.scenarios.schema import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_TENANTS,
    DISCOVER,
    INTENTS,
    NAME,
    PARAM_NAME,
    REFERENCE,
    STEP_KEYS,
    TOP_KEYS,
    CacheProbeStep,
    ClientSpec,
    EngineSpec,
    Expectation,
    LimitsSpec,
    Param,
    ParamValue,
    Path_,
    Scenario,
    SendKind,
    SendStep,
    Step,
    TenantsSpec,
    WaitStep,
)
from kvcanary.tenants.size import SizeSpec
from kvcanary.tenants.tenant import Tenant, env_name_problem


class ScenarioChecker(Fields):
    """Validates a parsed scenario document into a `Scenario`."""

    def scenario(self, doc: dict[str, Any], overrides: dict[str, str]) -> Scenario:
        self.keys((), doc, TOP_KEYS)
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
        if not NAME.fullmatch(name):
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
            if not PARAM_NAME.fullmatch(name):
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
            values[name] = coerce_param(param, raw)
        return values

    def substitute(self, path: Path_, value: Any, values: Mapping[str, ParamValue]) -> Any:
        """`value` with every `${name}` replaced (recursively through tables and arrays)."""
        if isinstance(value, dict):
            return {k: self.substitute((*path, k), v, values) for k, v in value.items()}
        if isinstance(value, list):
            return [self.substitute((*path, i), v, values) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        for match in REFERENCE.finditer(value):
            if match.group(1) not in values:
                self.fail(path, f"${{{match.group(1)}}} is not a declared parameter ([params])")
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
            if not matches(kind, value):
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
            if not isinstance(variable, str):
                self.fail((*path, name), "expected the NAME of an environment variable")
            problem = env_name_problem(variable)
            if problem is not None:
                self.fail((*path, name), problem)
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
        if kind not in STEP_KEYS:
            self.fail(
                (*path, "kind"),
                f"{kind!r}: expected victims, probes, disconnect, wait or cache_probe",
            )
        self.keys(path, body, STEP_KEYS[kind])
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

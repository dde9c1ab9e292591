"""Scenario validation, the `[[steps]]` array: each step checked into a `SendStep`,
`WaitStep` or `CacheProbeStep` (`harness.scenarios.checker` checks the rest of the file).

Each step, and each size expression, key and tenant of a step, is its own part: every
problem of every step is noted (`harness.scenarios.fields`), in the order the file has them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.scenarios.fields import Fields
from kvcanary.harness.scenarios.schema import (
    DEFAULT_MAX_TOKENS,
    INTENTS,
    STEP_KEYS,
    CacheProbeStep,
    Path_,
    SendKind,
    SendStep,
    Step,
    WaitStep,
)
from kvcanary.tenants.size import SizeSpec


class StepChecker(Fields):
    """Validates the `steps` array of a scenario document."""

    def steps(self, raw: Any, tenants: tuple[str, ...] | None) -> tuple[Step, ...]:
        if raw is None:
            return ()  # missing: noted with the other required keys
        if not isinstance(raw, list) or not raw:
            self.fail(("steps",), "expected one or more [[steps]] tables")
        read = [
            self.attempt(partial(self.step, ("steps", i), body, tenants), None)
            for i, body in enumerate(raw)
        ]
        steps = tuple(step for step in read if step is not None)
        if len(steps) == len(read) and not any(isinstance(s, SendStep) for s in steps):
            self.note(("steps",), "no step sends anything (victims, probes or disconnect)")
        seen: set[str] = set()
        for i, step in enumerate(read):
            if step is not None and step.name in seen:
                self.note(("steps", i, "name"), f"two steps are named {step.name!r}")
            seen.add(step.name if step is not None else "")
        return steps

    def step(self, path: Path_, raw: Any, tenants: tuple[str, ...] | None) -> Step:
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
        name = self.read(path, body, "name", self.string, f"{path[1] + 1}-{kind}")
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
        return self.send_step(path, body, send_kind, name, line, tenants)

    def send_step(
        self,
        path: Path_,
        body: dict[str, Any],
        kind: SendKind,
        name: str,
        line: int,
        tenants: tuple[str, ...] | None,
    ) -> SendStep:
        sizes = self.attempt(partial(self.sizes, path, body, kind), ())
        after_chunks = after_seconds = None
        if kind == "disconnect":
            if ("after_chunks" in body) == ("after_seconds" in body):
                self.note(path, "a disconnect needs `after_chunks` or `after_seconds` (one)")
            after_chunks = self.read(path, body, "after_chunks", self.whole, None)
            after_seconds = self.read(path, body, "after_seconds", self.number, None)
        count = partial(self.read, path, body)
        return SendStep(
            kind=kind,
            name=name,
            line=line,
            sizes=sizes,
            count=count("count", self.positive, len(sizes) or 1),
            concurrency=count("concurrency", self.positive, 1),
            max_tokens=count("max_tokens", self.positive, DEFAULT_MAX_TOKENS[kind]),
            tenants=self.step_tenants(path, body, tenants),
            after_chunks=after_chunks,
            after_seconds=after_seconds,
        )

    def whole(self, path: Path_, raw: Any) -> int:
        return self.integer(path, raw, 0)

    def positive(self, path: Path_, raw: Any) -> int:
        return self.integer(path, raw, 1)

    def step_tenants(
        self, path: Path_, body: dict[str, Any], tenants: tuple[str, ...] | None
    ) -> tuple[str, ...]:
        """The step's `tenants`, each one checked against `[tenants]` (where that is sound)."""
        names = self.read(path, body, "tenants", self.strings, ())
        for i, tenant in enumerate(names):
            if tenants is not None and tenant not in tenants:
                self.note((*path, "tenants", i), f"no tenant named {tenant!r} (see [tenants])")
        return names

    def cache_probe(
        self,
        path: Path_,
        body: dict[str, Any],
        name: str,
        line: int,
        tenants: tuple[str, ...] | None,
    ) -> CacheProbeStep:
        fraction = body.get("prefix_fraction", 0.875)
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            self.note((*path, "prefix_fraction"), f"expected a number, got {fraction!r}")
        elif not 0 < fraction < 1:
            self.note((*path, "prefix_fraction"), f"must be between 0 and 1, got {fraction}")
        salts = body.get("salts", False)
        if not isinstance(salts, bool):
            self.note((*path, "salts"), f"expected true or false, got {salts!r}")
        step_tenants = self.step_tenants(path, body, tenants)
        if step_tenants and len(set(step_tenants)) < 2:
            self.note((*path, "tenants"), "the probe needs at least two distinct tenants")
        read = partial(self.read, path, body)
        return CacheProbeStep(
            name=name,
            line=line,
            trials=read("trials", partial(self.integer, minimum=5), 20),
            prompt_tokens=read("prompt_tokens", partial(self.integer, minimum=2), None),
            prefix_fraction=float(fraction) if isinstance(fraction, int | float) else 0.875,
            salts=salts is True,
            tenants=step_tenants,
        )

    def sizes(self, path: Path_, body: dict[str, Any], kind: SendKind) -> tuple[SizeSpec, ...]:
        key = "size" if kind == "disconnect" else "sizes"
        if key not in body:
            self.fail(path, f'missing `{key}` (size expressions such as "pool+1")')
        raw = [body[key]] if key == "size" else body[key]
        if not isinstance(raw, list) or not raw:
            self.fail((*path, key), "expected a list of one or more size expressions")
        where = [(*path, key) if key == "size" else (*path, key, i) for i in range(len(raw))]
        specs = [
            self.attempt(partial(self.size, spot, expr, kind), None)
            for spot, expr in zip(where, raw, strict=True)
        ]
        return tuple(spec for spec in specs if spec is not None)

    def size(self, path: Path_, expr: Any, kind: SendKind) -> SizeSpec:
        if isinstance(expr, bool) or not isinstance(expr, str | int | float):
            self.fail(path, f'expected a size expression such as "pool+1", got {expr!r}')
        text = str(expr)
        try:
            return SizeSpec(text.replace(" ", ""), text, INTENTS[kind])
        except ConfigError as exc:
            self.fail(path, str(exc))

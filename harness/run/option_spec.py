"""One option of the registry (`harness.run.options`): how a setting is spelled, parsed,
explained and scoped, and how it reads in a scope where its general wording does not fit.

It knows no particular option, no precedence (`harness.run.config`) and no argparse
(`harness.run.option_flags`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvcanary.harness.run.option_values import int_within, parse_positive_int, parse_text, parse_url

Scope = Literal["run", "soak", "plugin", "audit", "repro"]
Action = Literal["value", "flag", "append", "optional"]
"""`optional`: a flag that may stand alone (`--ray`, meaning `const`) or take a value."""

PLUGIN_PREFIX = "--kvcanary-"
RUNS: tuple[Scope, ...] = ("run", "soak", "plugin")
"""The commands that run a workload, and the plugin (most options' scopes)."""

INHERIT: Final = object()
"""A `Variant` field left at this keeps the option's own value."""


@dataclass(frozen=True, slots=True)
class Variant:
    """How an option reads in one scope where its general wording or default does not fit."""

    help: str | None = None
    default: Any = INHERIT
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: how it is spelled, parsed and explained, and which commands take it."""

    name: str
    """The settings key (`pool_tokens`); flags and TOML keys are derived from it."""
    parse: Callable[[str], Any]
    default: Any
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    action: Action = "value"
    scopes: tuple[Scope, ...] = RUNS
    in_file: bool = True
    """Whether a config file may set it (`config` itself may not)."""
    aliases: tuple[str, ...] = ()
    """Other keys that spell the same flag (`engine` for `engine_preset`, in the plugin)."""
    variants: tuple[tuple[Scope, Variant], ...] = ()
    const: Any = None
    """An `optional` option's value when its flag is given without one."""

    @property
    def key(self) -> str:
        """The TOML key: the flag without its dashes (`pool-tokens`)."""
        return self.name.replace("_", "-")

    @property
    def cli_flag(self) -> str:
        return f"--{self.key}"

    @property
    def plugin_flag(self) -> str:
        return f"{PLUGIN_PREFIX}{self.key}"

    def in_scope(self, scope: Scope) -> Option:
        """This option as `scope` reads it (its `Variant` there applied)."""
        for where, variant in self.variants:
            if where == scope:
                return dataclasses.replace(
                    self,
                    help=variant.help or self.help,
                    default=self.default if variant.default is INHERIT else variant.default,
                    aliases=variant.aliases or self.aliases,
                    variants=(),
                )
        return self

    def coerce(self, value: Any) -> Any:
        """A parsed value from a command-line string or a TOML value; ValueError if unusable."""
        if self.action == "flag":
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            return value
        if self.action == "append":
            items = value if isinstance(value, list | tuple) else [value]
            return tuple(self.coerce_item(item) for item in items)
        return self.coerce_item(value)

    def coerce_item(self, value: Any) -> Any:
        """One parsed value (one element, for a repeatable option)."""
        # TOML gives ints and floats natively; booleans are never a valid number or name.
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError(f"expected a value like {self.metavar or 'TEXT'}, got {value!r}")
        parsed = self.parse(str(value))
        if self.choices is not None and parsed not in self.choices:
            raise ValueError(f"expected one of {', '.join(self.choices)}, got {value!r}")
        return parsed


def flag(name: str, help: str, scopes: tuple[Scope, ...] = RUNS) -> Option:
    """An on/off option (`--keep-raw-evidence`), off unless given."""
    return Option(name, parse_text, False, help, action="flag", scopes=scopes)


def count(
    name: str,
    default: int | None,
    help: str,
    scopes: tuple[Scope, ...] = RUNS,
    *,
    at_most: int | None = None,
    why: str = "",
) -> Option:
    """A positive whole number (`--tenants N`), with `at_most` its largest sensible value
    (`why` says why, after the range in the error)."""
    parse = parse_positive_int if at_most is None else int_within(1, at_most, why)
    return Option(name, parse, default, help, metavar="N", scopes=scopes)


def urls(name: str, help: str) -> Option:
    """A repeatable URL of the audit (`--prefill URL`)."""
    return Option(name, parse_url, (), help, metavar="URL", action="append", scopes=("audit",))

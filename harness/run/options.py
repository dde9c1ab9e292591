"""The run options, defined once as data: name, parser, default, help, and where each applies.

The `kvcanary run` / `kvcanary soak` parsers, the TOML config file (`[run]` / `[soak]`
tables) and the pytest plugin (`--kvcanary-<name>`, one option group) are all built from
`OPTIONS`, so an option's spelling, type, default and help text exist in one place.

This module knows how to parse one value and how to add options to an argparse parser. It
does not know how sources combine (flags over file over defaults) or which combinations are
valid; that is `harness.run.config`.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Scope = Literal["run", "soak", "plugin"]
Action = Literal["value", "flag", "append"]

PLUGIN_PREFIX = "--kvcanary-"

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(text: str) -> float:
    """Seconds from `30s`, `10m`, `8h`, `1h30m`, `250ms` or a bare number of seconds."""
    text = text.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
            pos = match.end()
        if pos != len(text) or not text:
            raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 10m, 8h)") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"a duration must be positive, got {text!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """The short form `parse_duration` reads back (`90` -> `1m30s`)."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    parts, rest = [], round(seconds)
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(parts) or "0s"


def parse_positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {text!r}")
    return value


def parse_non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return value


def parse_positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def parse_url(text: str) -> str:
    if not re.match(r"^https?://[^/\s]+", text):
        raise ValueError(f"expected an http(s) URL, got {text!r}")
    return text.rstrip("/")


def parse_env_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text):
        raise ValueError(f"expected an environment variable name, got {text!r}")
    return text


def parse_text(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a non-empty value")
    return text


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
    scopes: tuple[Scope, ...] = ("run", "soak", "plugin")
    in_file: bool = True
    """Whether a config file may set it (`config` itself may not)."""

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

    def coerce(self, value: Any) -> Any:
        """A parsed value from a command-line string or a TOML value; ValueError if unusable."""
        if self.action == "flag":
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            return value
        if self.action == "append":
            items = value if isinstance(value, list) else [value]
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


OPTIONS: tuple[Option, ...] = (
    Option(
        "target",
        parse_url,
        None,
        "Base URL of an OpenAI-compatible deployment. Without it, "
        "the bundled reference engine is started on a free loopback port.",
        metavar="URL",
    ),
    Option(
        "model",
        parse_text,
        None,
        "Model name to send (default: the first model the target lists at /v1/models).",
        metavar="NAME",
    ),
    Option(
        "api",
        parse_text,
        "completions",
        "Endpoint: /v1/chat/completions (the template's size is measured first) or "
        "/v1/completions (the prompt is exactly what is counted).",
        metavar="chat|completions",
        choices=("chat", "completions"),
    ),
    Option("tenants", parse_positive_int, 4, "Number of simulated tenants.", metavar="N"),
    Option(
        "requests",
        parse_positive_int,
        None,
        "Stop after N requests (default 60 when --duration is not given).",
        metavar="N",
        scopes=("run", "plugin"),
    ),
    Option(
        "duration",
        parse_duration,
        None,
        "Stop after this long: 30s, 10m, 8h (required for soak).",
        metavar="D",
    ),
    Option(
        "concurrency",
        parse_positive_int,
        None,
        "Closed loop: N requests in flight at all times (default without --rate: 8, or 1 "
        "for the bundled engine).",
        metavar="N",
    ),
    Option(
        "rate",
        parse_positive_float,
        None,
        "Open loop: Poisson arrivals at R requests per "
        "second, on an absolute clock (lateness is recorded as queue time).",
        metavar="R",
    ),
    Option(
        "pool_tokens",
        parse_positive_int,
        None,
        "The target's KV pool size in tokens (default: ask the target).",
        metavar="N",
    ),
    Option(
        "context_tokens",
        parse_positive_int,
        None,
        "The target's context length in tokens (default: ask the target).",
        metavar="N",
    ),
    Option(
        "page_size",
        parse_positive_int,
        None,
        "KV page size in tokens: every window of this many prompt tokens holds a whole "
        "canary (default: the target's, else 16).",
        metavar="N",
    ),
    Option(
        "tokenizer",
        parse_text,
        "cl100k_base",
        "Tokenizer for exact prompt lengths: a "
        "tiktoken encoding name, a tokenizer.json path, or `server` (the target's /tokenize).",
        metavar="NAME|server|PATH",
    ),
    Option(
        "api_key_env",
        parse_env_name,
        None,
        "Name of the environment variable holding the "
        "API key (the key itself is never written anywhere).",
        metavar="VAR",
    ),
    Option(
        "profile",
        parse_text,
        "incident",
        "Workload profile: incident (victims fill the pool, probes from the pool past the "
        "context), limits (only the edges), below (nothing over the limit).",
        metavar="NAME",
    ),
    Option(
        "seed",
        parse_non_negative_int,
        None,
        "Seed for prompts and arrivals; given, it also derives the canary key, so the run "
        "can be reproduced (default: random and recorded; the canary key is then random "
        "and never written).",
        metavar="N",
    ),
    Option(
        "timeout",
        parse_duration,
        120.0,
        "Per-request timeout (a whole streamed response).",
        metavar="D",
    ),
    Option(
        "out",
        parse_text,
        None,
        "Output directory (default ./kvcanary-runs/<UTC timestamp>).",
        metavar="DIR",
        scopes=("run", "soak"),
    ),
    Option(
        "config",
        parse_text,
        None,
        "TOML config file with a [run] table (flags override it).",
        metavar="FILE.toml",
        scopes=("run", "soak"),
        in_file=False,
    ),
    Option(
        "keep_raw_evidence",
        parse_text,
        False,
        "Keep response text verbatim in the journal "
        "and evidence (default: redacted to canary spans plus a hash).",
        action="flag",
    ),
    Option(
        "engine_preset",
        parse_text,
        "vulnerable",
        "Preset of the bundled engine (used without --target).",
        metavar="vulnerable|hardened",
        choices=("vulnerable", "hardened"),
    ),
    Option(
        "engine_fix",
        parse_text,
        (),
        "Turn on one fix switch of the bundled engine (repeatable).",
        metavar="NAME",
        action="append",
    ),
    Option(
        "engine_prefix_cache",
        parse_text,
        False,
        "Turn on the bundled engine's prefix cache (used without --target; shared by every "
        "tenant unless --engine-fix cache_salt or derive_cache_salt).",
        action="flag",
    ),
    Option(
        "cache_probe",
        parse_text,
        False,
        "Before the workload, run the cross-tenant prefix-cache timing probe (paired "
        "controls, KS and Mann-Whitney tests, Holm across tenant pairs): a "
        "shared_prefix_cache finding when one tenant is served from another's cache.",
        action="flag",
        scopes=("run", "plugin"),
    ),
    Option(
        "cache_probe_trials",
        parse_positive_int,
        20,
        "Timed trials per arm of the cache probe (more for noisy targets or small effects).",
        metavar="N",
        scopes=("run", "plugin"),
    ),
    Option(
        "cache_probe_salts",
        parse_text,
        False,
        "Give each tenant its own random cache_salt in the cache probe, which adds the "
        "spoofed-salt test (a tenant sending another tenant's salt).",
        action="flag",
        scopes=("run", "plugin"),
    ),
    Option(
        "report_every",
        parse_duration,
        600.0,
        "Re-render the report this often.",
        metavar="D",
        scopes=("soak",),
    ),
    Option(
        "rotate_every",
        parse_duration,
        3600.0,
        "Start a new journal segment this often.",
        metavar="D",
        scopes=("soak",),
    ),
    Option(
        "force",
        parse_text,
        False,
        "Resume into an --out whose journal belongs to a different target or seed.",
        action="flag",
        scopes=("soak",),
    ),
)

OPTIONS_BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}


def options_for(scope: Scope) -> tuple[Option, ...]:
    return tuple(option for option in OPTIONS if scope in option.scopes)


def add_to_parser(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    options: Iterable[Option],
    *,
    prefix: str = "--",
) -> None:
    """Add `options` as flags spelled `<prefix><key>`, each defaulting to "not given" (None).

    Defaults are applied later, by `run_config`, so a flag left out never hides a value from
    the config file.
    """
    for option in options:
        flag = f"{prefix}{option.key}"
        help_text = option.help
        if option.default not in (None, False, ()):
            shown = option.default
            if option.parse is parse_duration:
                shown = format_duration(option.default)
            help_text = f"{help_text} Default: {shown}."
        if option.action == "flag":
            parser.add_argument(
                flag,
                dest=option.name,
                action="store_const",
                const=True,
                default=None,
                help=help_text,
            )
            continue
        parser.add_argument(
            flag,
            dest=option.name,
            type=_argparse_type(option),
            action="append" if option.action == "append" else "store",
            default=None,
            metavar=option.metavar,
            help=help_text,
        )


def given_values(namespace: argparse.Namespace, options: Sequence[Option]) -> dict[str, Any]:
    """The options the user actually gave on the command line, keyed by name."""
    values: dict[str, Any] = {}
    for option in options:
        value = getattr(namespace, option.name, None)
        if value is None:
            continue
        values[option.name] = tuple(value) if option.action == "append" else value
    return values


def _argparse_type(option: Option) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return option.coerce_item(text)
        except ValueError as exc:
            # argparse turns ArgumentTypeError into "argument --x: <message>", exit 2
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = option.key
    return convert

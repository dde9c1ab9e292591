"""The generic half of scenario validation: where each key was written, and typed reads of
TOML values that fail with `FILE:LINE: FIELD: problem` (`harness.scenarios.checker` holds
the scenario-specific half).

Every problem of a file is reported at once, in file order: a read that fails notes its
problem and abandons only the part it was reading (`Fields.attempt` is where checking picks
up again), and `Fields.checked` raises one `ConfigError` naming them all. A value whose
`${param}` could not be substituted is noted once; reads under it stay silent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NoReturn, TypeVar

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.run.option_values import parse_url
from kvcanary.harness.scenarios.schema import Param, ParamValue, Path_, parse_param_value

_T = TypeVar("_T")
_F = TypeVar("_F")


class Invalid(Exception):
    """A problem already noted: stop checking the part being read (see `Fields.attempt`)."""


# -- where each key was written ----------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'')
_BARE_OR_QUOTED = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_KEY = re.compile(rf"^\s*({_BARE_OR_QUOTED}(?:\s*\.\s*{_BARE_OR_QUOTED})*)\s*=")
_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_BARE_OR_QUOTED}(?:\s*\.\s*{_BARE_OR_QUOTED})*)\s*\]\]?")


def _split_key(key: str) -> tuple[str, ...]:
    parts = re.findall(_BARE_OR_QUOTED, key)
    return tuple(p[1:-1] if p[:1] in "\"'" else p for p in parts)


def key_lines(text: str) -> dict[Path_, int]:
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


class Fields:
    """Typed reads of a parsed document; every problem names the file, the line and the field."""

    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.lines = key_lines(text)
        self.problems: list[tuple[int, str]] = []
        """(line, `FILE:LINE: FIELD: problem`) in the order they were found."""
        self.broken: set[Path_] = set()
        """Values whose problem is noted already: nothing under them is reported again."""

    def line_of(self, path: Path_) -> int:
        """The line of `path`, or of its nearest enclosing key or table; 1 if none."""
        for end in range(len(path), 0, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return 1

    def note(self, path: Path_, message: str) -> None:
        """Record a problem at `path` and go on checking."""
        if any(path[:end] in self.broken for end in range(len(path) + 1)):
            return
        line = self.line_of(path)
        self.problems.append((line, f"{self.source}:{line}: {_field(path)}: {message}"))

    def fail(self, path: Path_, message: str) -> NoReturn:
        """Record a problem at `path` and abandon the part being read."""
        self.note(path, message)
        raise Invalid(message)

    def attempt(self, read: Callable[[], _T], fallback: _F) -> _T | _F:
        """`read()`, or `fallback` when it failed (its problems noted): checking goes on."""
        try:
            return read()
        except Invalid:
            return fallback

    def checked(self, read: Callable[[], _T]) -> _T:
        """`read()` when the document has no problem; else one `ConfigError` naming every
        problem, in file order (one problem: its line alone)."""
        try:
            result = read()
        except Invalid:
            assert self.problems, "a part was abandoned without a problem noted"
        if self.problems:
            found = [text for _, text in sorted(self.problems, key=lambda item: item[0])]
            if len(found) == 1:
                raise ConfigError(found[0])
            raise ConfigError("\n".join([f"{self.source}: {len(found)} problems", *found]))
        return result

    def read(
        self,
        path: Path_,
        body: Mapping[str, Any],
        key: str,
        read: Callable[[Path_, Any], _T],
        default: _F,
    ) -> _T | _F:
        """`read((*path, key), body[key])` (the default where the key is absent); the default
        also stands in when the value is wrong, its problem noted."""
        if key not in body:
            return default
        return self.attempt(partial(read, (*path, key), body[key]), default)

    # -- the document --------------------------------------------------------------

    def keys(self, path: Path_, body: Mapping[str, Any], allowed: Sequence[str]) -> None:
        """Note every key of `body` that is not `allowed` (the rest is still checked)."""
        for key in body:
            if key not in allowed:
                self.note((*path, key), f"unknown key (expected one of: {', '.join(allowed)})")

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
        found = len(self.problems)
        items = tuple(
            self.attempt(partial(self.string, (*path, i), item), "") for i, item in enumerate(raw)
        )
        if len(self.problems) > found:
            raise Invalid(f"{_field(path)}: a bad item")
        return items

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
        try:
            return parse_url(text)
        except ValueError as exc:
            self.fail(path, str(exc))


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


def coerce_param(param: Param, raw: str) -> ParamValue:
    """A command-line value for `param`: the default's type where that is a number or bool."""
    value = parse_param_value(raw)
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


def matches(kind: str, value: Any) -> bool:
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


def param_text(value: ParamValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)

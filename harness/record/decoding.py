"""Journal records back into dataclasses, checked against the dataclasses' own annotations.

A journal is input like any other: a torn disk, a hand edit or a newer kvcanary can put
anything in a line. So a record is rebuilt field by field from the annotations of the
dataclass it was written from (the same declarations `harness.record.columns` reads), and
every value is checked on the way in:

- a value of the wrong JSON type, an integer outside int64, a float that is not finite, or a
  missing required field raises `RecordError` (the reader skips the record with a warning);
- a field the dataclass does not declare (a newer kvcanary's) is dropped and its dotted name
  (`observation.usage.reasoning_tokens`) added to `unknown`: the record is kept;
- a `Literal` field takes any string (a newer version may add values); an enum field only
  its members.

The converters are built once per annotation, so a million records cost a few microseconds
each.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Callable, Hashable
from typing import Any, Literal, TypeVar, Union, cast

INT64_MAX = 2**63 - 1
T = TypeVar("T")

Converter = Callable[[Any, str, set[str]], Any]
"""(value, where, unknown names) -> the value as the annotation declares it."""


class RecordError(ValueError):
    """A journal record does not match its declaration."""


def build(cls: type[T], value: Any, where: str, unknown: set[str]) -> T:
    """An instance of dataclass `cls` from a JSON object (see the module docstring)."""
    converted: T = _converter(cast(Hashable, cls))(value, where, unknown)
    return converted


def convert(annotation: Any, value: Any, where: str, unknown: set[str]) -> Any:
    """`value` as `annotation` declares it (a field's annotation), checked the same way."""
    return _converter(annotation)(value, where, unknown)


@functools.cache
def _converter(annotation: Any) -> Converter:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return lambda value, where, unknown: value
    if origin in (Union, types.UnionType):
        return _optional(annotation)
    if origin is Literal:
        [kind] = {type(value) for value in typing.get_args(annotation)}
        return _scalar(kind)
    if origin is tuple:
        return _sequence(typing.get_args(annotation))
    if origin is dict or annotation is dict:
        return _scalar(dict)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _member(annotation)
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return _dataclass(annotation)
    if annotation in (bool, int, float, str):
        return _scalar(annotation)
    raise TypeError(f"no journal decoding for {annotation!r}")


def _optional(annotation: Any) -> Converter:
    inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if len(inner) != 1:
        raise TypeError(f"no journal decoding for {annotation!r}")
    convert = _converter(inner[0])

    def optional(value: Any, where: str, unknown: set[str]) -> Any:
        return None if value is None else convert(value, where, unknown)

    return optional


def _scalar(kind: type) -> Converter:
    def scalar(value: Any, where: str, unknown: set[str]) -> Any:
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise RecordError(f"{where}: expected {kind.__name__}, got {_json_type(value)}")
        if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise RecordError(f"{where}: integer out of range")
        if isinstance(value, float) and not math.isfinite(value):
            raise RecordError(f"{where}: number out of range")
        return value

    return scalar


def _member(kind: type[enum.Enum]) -> Converter:
    def member(value: Any, where: str, unknown: set[str]) -> Any:
        try:
            return kind(value)
        except (ValueError, TypeError):
            raise RecordError(f"{where}: {str(value)[:40]!r} is not a known value") from None

    return member


def _sequence(args: tuple[Any, ...]) -> Converter:
    variadic = len(args) == 2 and args[1] is Ellipsis
    items = [_converter(arg) for arg in (args[:1] if variadic else args)]

    def sequence(value: Any, where: str, unknown: set[str]) -> Any:
        if not isinstance(value, list | tuple):
            raise RecordError(f"{where}: expected a list, got {_json_type(value)}")
        if variadic:
            return tuple(items[0](item, where, unknown) for item in value)
        if len(value) != len(items):
            raise RecordError(f"{where}: expected {len(items)} items, got {len(value)}")
        pairs = zip(items, value, strict=True)
        return tuple(convert(item, where, unknown) for convert, item in pairs)

    return sequence


def _dataclass(cls: type) -> Converter:
    hints = typing.get_type_hints(cls)
    fields = {field.name: _converter(hints[field.name]) for field in dataclasses.fields(cls)}
    # Values whose exact type a field takes as it is (most of them) skip their converter.
    as_is = {name: _as_is(hints[name]) for name in fields}

    def instance(value: Any, where: str, unknown: set[str]) -> Any:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {_json_type(value)}")
        arguments = {}
        for name, item in value.items():
            kind = type(item)
            if kind in as_is.get(name, ()) and (kind is not int or _MIN <= item <= INT64_MAX):
                arguments[name] = item
                continue
            convert = fields.get(name)
            if convert is None:
                unknown.add(f"{where}.{name}")
            else:
                arguments[name] = convert(item, f"{where}.{name}", unknown)
        try:
            return cls(**arguments)
        except TypeError as exc:  # a required field is missing
            raise RecordError(f"{where}: {exc}") from None

    return instance


_MIN = -INT64_MAX - 1


def _as_is(annotation: Any) -> frozenset[type]:
    """The JSON value types a field of `annotation` takes unconverted (floats still go
    through their converter: only it refuses one that is not finite)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return frozenset().union(*(_as_is(arg) for arg in typing.get_args(annotation)))
    if annotation is type(None):
        return frozenset({type(None)})
    if origin is Literal:
        return frozenset({type(value) for value in typing.get_args(annotation)})
    if annotation in (bool, int, str):
        return frozenset({annotation})
    return frozenset()


class UnknownFields:
    """Field names a journal holds that this version does not declare, each said once.

    `note` collects them (with where each was first seen) and `warn` says the new ones; a
    reader that may still give up and start over (`reports.journal_scan`) notes while it
    reads and warns only once it is done."""

    def __init__(self) -> None:
        self.first_seen: dict[str, str] = {}
        self._warned: set[str] = set()

    def note(self, names: set[str], where: str) -> None:
        for name in names:
            self.first_seen.setdefault(name, where)

    def warn(self, say: Callable[[str], None]) -> None:
        for name, where in sorted(self.first_seen.items()):
            if name not in self._warned:
                say(
                    f"{where}: field {name!r} is not known to this kvcanary (written by a "
                    "newer version?); its records are kept without it"
                )
                self._warned.add(name)


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    names |= {list: "a list", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)

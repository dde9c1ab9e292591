"""The journal's request records as Arrow columns, derived from their declarations.

A fast reader (`reports.journal_scan`) parses plan and observation lines with Arrow against
an explicit schema of the few fields it needs. Those fields are the dataclasses the journal
writes (`tenants.plan.RequestPlan` without its prompt, `harness.record.observation.
Observation`), so their Arrow types are read from the dataclasses' annotations here, never
typed out again: a field renamed or retyped in its dataclass changes the schema with it.

    str, Literal[...] -> string     int -> int64     float -> float64    bool -> bool
    X | None -> X (nullable)        a dataclass -> struct   tuple[X, ...] -> list<X>

Imported only by readers that use Arrow (the harness and the pytest plugin never load it).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Union

import pyarrow as pa

from kvcanary.harness.record.events import RECORD_BODIES

_SCALARS: dict[type, pa.DataType] = {
    bool: pa.bool_(),
    int: pa.int64(),
    float: pa.float64(),
    str: pa.string(),
}


def arrow_type(annotation: Any, names: Iterable[str] | None = None) -> pa.DataType:
    """The Arrow type of a field annotation; `names` picks a struct's (nested) fields."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        [inner] = [a for a in typing.get_args(annotation) if a is not type(None)]
        return arrow_type(inner, names)
    if origin is Literal:
        [kind] = {type(value) for value in typing.get_args(annotation)}
        return _SCALARS[kind]
    if origin in (tuple, list):
        return pa.list_(arrow_type(typing.get_args(annotation)[0], names))
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return pa.struct(fields_of(annotation, names))
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    raise TypeError(f"no Arrow column for a field of type {annotation!r}")


def fields_of(record: type, names: Iterable[str] | None = None) -> list[pa.Field]:
    """Arrow fields of a dataclass: all of them, or those `names` picks (`usage.cached_tokens`
    picks one field of a nested struct), in the order given."""
    hints = typing.get_type_hints(record)
    if names is None:
        names = [field.name for field in dataclasses.fields(record)]
    nested: dict[str, list[str] | None] = {}
    for name in names:
        head, _, rest = name.partition(".")
        if head not in hints:
            raise KeyError(f"{record.__name__} has no field {head!r}")
        if rest:
            picked = nested.setdefault(head, [])
            if picked is not None:
                picked.append(rest)
        else:
            nested[head] = None
    return [pa.field(name, arrow_type(hints[name], picked)) for name, picked in nested.items()]


def line_schema(columns: Mapping[str, Iterable[str]]) -> pa.Schema:
    """One schema for journal lines of several record types (`plan`, `observation`): `type`,
    then each type's picked columns; a name two types share must have one type."""
    fields: dict[str, pa.Field] = {"type": pa.field("type", pa.string())}
    for record_type, names in columns.items():
        for field in fields_of(RECORD_BODIES[record_type], names):
            known = fields.setdefault(field.name, field)
            if not known.type.equals(field.type):
                raise TypeError(f"{field.name!r} is {known.type} in one record, {field.type} here")
    return pa.schema(list(fields.values()))

"""Many instances of a slotted class at once, from columns of their field values.

A 1,048,576-token prompt holds ~105k canaries (`CanarySpan`s) and its echo as many hits
(`Hit`s), and a frozen dataclass's `__init__` costs about as much per instance as the work
that found its values. So `records_from_columns` makes each instance as `object.__new__(cls)`
and stores each field through its slot's own descriptor (`getattr(cls, name).__set__`):
the class's public protocols (copy and pickle restore a slotted object the same way), no
`__init__`, nothing assumed about the instance's layout. The cyclic collector is paused
meanwhile: the burst of new objects would otherwise trigger collections that cost more than
it.

The compiled core (`canaries/_columns.c`, `from_columns`) does the same in one C loop,
through the same protocols (`canaries/_records.h`, which the scanner's core also uses for
the hits it makes); without it (no C compiler at install), C-level map loops do it here.
Either way the instances equal `cls(*row)`.

The other way, `field_record` turns one instance into the dict the journal and summary.json
record: its fields by name, with the few renames and derived values each class declares.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import islice, repeat
from types import MemberDescriptorType
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
FromColumns = Callable[..., tuple[Any, ...]]


def _load_core() -> FromColumns | None:
    try:
        from kvcanary.canaries._columns import from_columns
    except ImportError:  # installed without a C compiler: the map loops below
        return None
    return from_columns


CORE: FromColumns | None = _load_core()
"""`canaries._columns.from_columns` (one C loop for all the instances, ~4x faster than the
map loops: benchmarks/RESULTS.md), or None when it was not built."""


def records_from_columns(
    cls: type[T], fields: tuple[str, ...], first: Sequence[Any], *columns: Iterable[Any]
) -> tuple[T, ...]:
    """`cls` instances with `fields[f] = columns[f][i]` for each row i (`first` being
    column 0), equal to `cls(*row)` for a dataclass whose fields are all slots. A column
    that is not a list or tuple is read as far as `first` goes (`repeat(x)` is fine)."""
    if 1 + len(columns) != len(fields):
        raise ValueError("one column for each field")
    lists: list[Sequence[Any]] = [first if isinstance(first, list | tuple) else list(first)]
    for column in columns:
        if not isinstance(column, list | tuple):
            column = list(islice(column, len(lists[0])))
        lists.append(column)
    if CORE is not None:
        made: tuple[T, ...] = CORE(cls, fields, *lists)
        return made
    slots = [getattr(cls, name) for name in fields]
    for name, slot in zip(fields, slots, strict=True):
        if not isinstance(slot, MemberDescriptorType):
            raise TypeError(f"{cls.__name__}.{name} is not a slot")
    if any(len(column) != len(lists[0]) for column in lists):
        raise ValueError("columns of different lengths")
    with gc_paused():
        records: list[T] = list(map(object.__new__, repeat(cls, len(lists[0]))))
        for slot, column in zip(slots, lists, strict=True):
            any(map(slot.__set__, records, column))  # any(): run it
    return tuple(records)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused: a burst of ~10^5 new container objects (hits,
    records) otherwise triggers collections that traverse every object alive."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def field_record(
    instance: DataclassInstance, *, renamed: Mapping[str, str] | None = None, **values: Any
) -> dict[str, Any]:
    """`instance`'s fields in declaration order, each under its `renamed` key where it has
    one; a value in `values` under a field's key replaces that field's value in place (a
    rounding), the others (derived values) follow the fields. Values are not copied."""
    renamed = renamed or {}
    fields = dataclasses.fields(instance)
    return {renamed.get(f.name, f.name): getattr(instance, f.name) for f in fields} | values

from typing import Any, TypeVar

_T = TypeVar("_T")

def spell(digits: Any, table: bytes, row: int, prefix: bytes, /) -> list[str]:
    """For each row d of digits (2-d int64), prefix + the table's rows of row bytes at d,
    as one ASCII str (see canaries/_columns.c)."""

def from_columns(
    type: type[_T], fields: tuple[str, ...], /, *columns: list[Any] | tuple[Any, ...]
) -> tuple[_T, ...]:
    """type instances with fields[f] = columns[f][i]: object.__new__, then each slot's own
    __set__ (see canaries/_records.h); canaries.records.records_from_columns calls it."""

from collections.abc import Callable
from typing import Any, TypeVar

_H = TypeVar("_H")

def fold_scan(
    text: str, k: int, fold: Callable[[int], int], /
) -> tuple[bytes, list[int], list[int]] | None:
    """(fold_bytes(text), the fragment windows of k words in it, the starts of the tag in
    it), or None where fold_bytes gives None (see canaries/_foldscan.c)."""

def resolve_tags(
    text: str,
    tags: list[int] | None,
    length: int,
    live: dict[str, Any],
    lowered: bytes | None,
    needle: str,
    /,
) -> tuple[list[int], list[str], list[Any], list[int]]:
    """(starts, texts, owners) of the exact canaries among the candidates, and the other
    candidates (seeds); see canaries/_foldscan.c."""

def exact_hits(
    hit_type: type[_H],
    canaries: list[str],
    starts: list[int],
    base: int,
    length: int,
    layer: str,
    origins: dict[str, Any],
    owners: list[Any],
    /,
) -> list[_H]:
    """The exact hits of canaries at starts, made slot by slot (see canaries/_foldscan.c)."""

def outside(windows: list[int], starts: list[int], length: int, width: int, /) -> list[int]:
    """The windows [p, p + width) overlapping no [s, s + length) (see canaries/_foldscan.c)."""

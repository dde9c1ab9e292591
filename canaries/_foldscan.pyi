from collections.abc import Callable
from typing import Any, TypeVar

_H = TypeVar("_H")

def fold_scan(
    text: str, k: int, fold: Callable[[int], int], /
) -> tuple[bytes, bytes, bytes] | None:
    """(fold_bytes(text), the fragment windows of k words in it, the starts of the tag in
    it), or None where fold_bytes gives None; windows and tags are packed positions
    (memoryview(b).cast("n")); see canaries/_foldscan.c."""

def exact_scan(
    text: str,
    tags: bytes | None,
    length: int,
    live: dict[str, Any],
    resolved: dict[str, tuple[str, Any, Any]],
    lowered: bytes | None,
    needle: str,
    hit_type: type[_H],
    base: int,
    after: int,
    until: int,
    windows: bytes | None,
    width: int,
    /,
) -> tuple[list[_H], list[str], list[int], list[int] | None]:
    """(the exact hits ending in (after, until], the live canaries missing from resolved,
    the other candidates (seeds), the windows overlapping no exact canary or None); see
    canaries/_foldscan.c."""

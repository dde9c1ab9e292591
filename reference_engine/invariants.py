"""Runtime checks of a side's page bookkeeping: real checks, not asserts, so `python -O` keeps them.

What it checks, on one side's `PageAllocator` and the requests the side knows are alive:

    pool accounting   every usable page is free exactly once or owned exactly once; the
                      reserved page is never free
    ownership         every page a live request holds is owned by that request (or, on
                      prefill with a prefix cache, by the cache)
    lost pages        every allocated page belongs to a live request or to the cache: a page
                      whose owner finished and never gave it back is lost to the pool

A failed check raises `InvariantViolation`; the side's scheduler loop treats it like any crash
(`SideBase`): one clear log line, every live request failed with a 500, `/health` 503.

What it deliberately does not know: why pages are held. The side passes its live requests
(`LiveRequest`: an id and page ids) and the owners that hold pages legitimately without a
request (the prefix cache).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from typing import Protocol


class InvariantViolation(RuntimeError):
    """The engine's own bookkeeping is wrong: a bug, never a client's mistake."""


class Pool(Protocol):
    """What the checks read of a `PageAllocator`."""

    num_pages: int

    @property
    def free_page_ids(self) -> Iterable[int]: ...

    @property
    def release_page_ids(self) -> Iterable[int]: ...

    @property
    def owners(self) -> Sequence[str | None]: ...


class LiveRequest(Protocol):
    @property
    def rid(self) -> str: ...

    @property
    def page_ids(self) -> Sequence[int]: ...


RESERVED_PAGE = 0


def check_pool_accounting(pool: Pool) -> None:
    """Every usable page is free exactly once or owned exactly once."""
    free = [*pool.free_page_ids, *pool.release_page_ids]
    counts = Counter(free)
    twice = sorted(p for p, n in counts.items() if n > 1)
    if twice:
        raise InvariantViolation(f"page(s) {_few(twice)} are on the free lists twice")
    if RESERVED_PAGE in counts:
        raise InvariantViolation(f"the reserved page {RESERVED_PAGE} is on a free list")
    owned_and_free = sorted(p for p in counts if pool.owners[p] is not None)
    if owned_and_free:
        raise InvariantViolation(f"free page(s) {_few(owned_and_free)} have an owner")
    num_owned = sum(owner is not None for owner in pool.owners)
    num_usable = pool.num_pages - 1
    if num_owned + len(free) != num_usable:
        raise InvariantViolation(
            f"{num_usable - num_owned - len(free)} page(s) are neither free nor owned "
            f"({num_owned} owned + {len(free)} free of {num_usable})"
        )


def check_request_pages(
    pool: Pool, live: Iterable[LiveRequest], shared_owners: Collection[str] = ()
) -> None:
    """Live requests own their pages, and no allocated page is lost to a finished owner."""
    live_ids = set(shared_owners)
    for req in live:
        live_ids.add(req.rid)
        for page_id in req.page_ids:
            if not 0 < page_id < pool.num_pages:
                raise InvariantViolation(f"request {req.rid} holds page id {page_id}, not a page")
            owner = pool.owners[page_id]
            if owner != req.rid and owner not in shared_owners:
                raise InvariantViolation(
                    f"page {page_id} of live request {req.rid} is owned by {owner!r}"
                )
    lost = Counter(o for o in pool.owners if o is not None and o not in live_ids)
    if lost:
        owner, num = lost.most_common(1)[0]
        raise InvariantViolation(
            f"{sum(lost.values())} page(s) lost: owned by {len(lost)} request(s) no longer "
            f"live (e.g. {num} owned by {owner!r})"
        )


def check_side_pages(
    pool: Pool, live: Iterable[LiveRequest], shared_owners: Collection[str] = ()
) -> None:
    """Both checks, pool accounting first."""
    check_pool_accounting(pool)
    check_request_pages(pool, live, shared_owners)


def _few(page_ids: Sequence[int], limit: int = 5) -> str:
    shown = ", ".join(str(p) for p in page_ids[:limit])
    return shown + (f" (+{len(page_ids) - limit} more)" if len(page_ids) > limit else "")

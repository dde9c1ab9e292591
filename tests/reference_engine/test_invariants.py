"""The runtime page checks: real checks (not asserts) that name what is wrong."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvcanary.reference_engine.allocator import PageAllocator
from kvcanary.reference_engine.invariants import (
    InvariantViolation,
    check_pool_accounting,
    check_request_pages,
    check_side_pages,
)


@dataclass
class Live:
    rid: str
    page_ids: list[int] = field(default_factory=list)


def pool_with(owners: dict[str, int], free_order: str = "sorted") -> PageAllocator:
    pool = PageAllocator(17, free_order)
    for owner, num in owners.items():
        pool.allocate(num, owner)
    return pool


def test_a_consistent_pool_and_its_live_requests_pass() -> None:
    pool = pool_with({"a": 3, "b": 2})
    live = [Live("a", pool.owned_pages("a")), Live("b", pool.owned_pages("b"))]
    check_side_pages(pool, live)
    pool.free(live[0].page_ids, "a")
    check_side_pages(pool, live[1:])


def test_a_page_free_twice_is_reported() -> None:
    pool = pool_with({"a": 2})
    page = pool.owned_pages("a")[0]
    pool.free([page], "a")
    pool.release_page_ids.append(page)  # what a double free does without the allocator's check
    with pytest.raises(InvariantViolation, match=rf"page\(s\) {page} are on the free lists twice"):
        check_pool_accounting(pool)


def test_a_free_page_with_an_owner_and_a_vanished_page_are_reported() -> None:
    pool = pool_with({"a": 2})
    pool.owners[pool.free_page_ids[0]] = "b"
    with pytest.raises(InvariantViolation, match="have an owner"):
        check_pool_accounting(pool)
    pool = pool_with({"a": 2})
    pool.free_page_ids.popleft()  # neither free nor owned
    with pytest.raises(InvariantViolation, match=r"1 page\(s\) are neither free nor owned"):
        check_pool_accounting(pool)


def test_a_live_request_whose_page_another_owns_is_reported() -> None:
    pool = pool_with({"a": 2, "b": 1})
    stolen = pool.owned_pages("b")[0]
    live = [Live("a", [*pool.owned_pages("a"), stolen]), Live("b", [stolen])]
    expected = rf"page {stolen} of live request a is owned by 'b'"
    with pytest.raises(InvariantViolation, match=expected):
        check_request_pages(pool, live)


def test_pages_of_a_finished_request_are_lost_pages() -> None:
    pool = pool_with({"a": 2, "gone": 3})
    with pytest.raises(InvariantViolation, match=r"3 page\(s\) lost: .* 3 owned by 'gone'"):
        check_request_pages(pool, [Live("a", pool.owned_pages("a"))])


def test_a_shared_owner_such_as_the_prefix_cache_is_not_lost() -> None:
    pool = pool_with({"a": 2, "prefix-cache": 2})
    cached = pool.owned_pages("prefix-cache")
    live = [Live("a", [*cached, *pool.owned_pages("a")])]
    check_request_pages(pool, live, shared_owners=("prefix-cache",))
    with pytest.raises(InvariantViolation, match="owned by 'prefix-cache'"):
        check_request_pages(pool, live)

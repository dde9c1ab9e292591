"""PageAllocator: reserved page 0, free orders, ownership and generations (no torch)."""

from __future__ import annotations

import random

import pytest

from kvcanary.reference_engine.allocator import PageAllocator
from kvcanary.reference_engine.invariants import InvariantViolation


def test_page_zero_is_never_handed_out() -> None:
    allocator = PageAllocator(5, "lifo")
    assert allocator.num_usable_pages == 4
    assert sorted(allocator.allocate(4, "a")) == [1, 2, 3, 4]
    assert not allocator.can_allocate(1)


def test_lifo_reuses_the_freed_pages_first_in_their_order() -> None:
    allocator = PageAllocator(9, "lifo")
    a = allocator.allocate(3, "a")
    allocator.allocate(2, "b")
    allocator.free(a, "a")
    assert allocator.allocate(3, "c") == a


def test_sorted_keeps_released_pages_until_the_free_list_runs_short() -> None:
    allocator = PageAllocator(9, "sorted")
    a = allocator.allocate(3, "a")  # 1, 2, 3
    allocator.free(a, "a")
    assert allocator.allocate(2, "b") == [4, 5]  # fresh pages first
    assert allocator.allocate(4, "c") == [1, 2, 3, 6]  # merged and sorted
    allocator.check_consistent()


def test_generation_is_bumped_on_every_reallocation() -> None:
    allocator = PageAllocator(3, "lifo")
    [page] = allocator.allocate(1, "a")
    first = allocator.generations[page]
    allocator.free([page], "a")
    assert allocator.allocate(1, "b") == [page]
    assert allocator.generations[page] == first + 1
    assert allocator.owners[page] == "b"
    assert allocator.owned_pages("b") == [page]


def test_freeing_a_page_one_does_not_own_is_a_bug() -> None:
    allocator = PageAllocator(4, "lifo")
    pages = allocator.allocate(2, "a")
    with pytest.raises(InvariantViolation, match="owned by a"):
        allocator.free(pages, "b")


def test_over_allocation_is_refused() -> None:
    allocator = PageAllocator(4, "sorted")
    assert allocator.can_allocate(3)
    assert not allocator.can_allocate(4)
    with pytest.raises(InvariantViolation):
        allocator.allocate(4, "a")


@pytest.mark.parametrize("free_order", ["lifo", "sorted"])
def test_random_allocate_free_keeps_every_page_owned_or_free_once(free_order: str) -> None:
    rng = random.Random(7)
    allocator = PageAllocator(64, free_order)
    live: dict[str, list[int]] = {}
    for i in range(2000):
        if live and (rng.random() < 0.5 or not allocator.can_allocate(1)):
            owner = rng.choice(sorted(live))
            allocator.free(live.pop(owner), owner)
        else:
            n = rng.randint(1, 8)
            if allocator.can_allocate(n):
                live[f"r{i}"] = allocator.allocate(n, f"r{i}")
        allocator.check_consistent()
        assert allocator.num_allocated_pages == sum(map(len, live.values()))
    owned = [p for pages in live.values() for p in pages]
    assert len(owned) == len(set(owned))

"""The page allocator of one KV pool (torch-free, like nano-vllm's block manager).

What it knows: which pages are free, who owns each allocated page (request id) and how many
times each page has been handed out (its generation, bumped on every allocation), and the
order in which freed pages come back:

    lifo     freed pages are prepended to the free list, so the next allocation reuses them
             first, in the freed request's order (SGLang without PD)
    sorted   freed pages go to a release list that is merged into the free list, sorted,
             only when the free list runs short (SGLang PD mode, `need_sort`)

Page 0 is reserved: block tables are padded with it and it is never handed out.

What it deliberately does not know: the KV bytes. Pages are never zeroed here (SGLang never
zeroes them either); the `zero_on_free` fix is applied by the side that owns the KV tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvcanary.reference_engine.config import FREE_ORDERS
from kvcanary.reference_engine.invariants import InvariantViolation

RESERVED_PAGE = 0


class PageAllocator:
    """Free pages, owners and generations of a pool of `num_pages` pages (page 0 reserved)."""

    def __init__(self, num_pages: int, free_order: str) -> None:
        assert num_pages >= 2, "a pool needs the reserved page and at least one more"
        assert free_order in FREE_ORDERS, f"unknown free order {free_order!r}"
        self.num_pages = num_pages
        self.free_order = free_order
        self.free_page_ids: deque[int] = deque(range(1, num_pages))
        self.release_page_ids: list[int] = []
        self.owners: list[str | None] = [None] * num_pages
        self.generations: list[int] = [0] * num_pages

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self.free_page_ids) + len(self.release_page_ids)

    @property
    def num_allocated_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def allocate(self, num_pages: int, owner: str) -> list[int]:
        """Hand out `num_pages` pages to `owner`; each page's generation is bumped."""
        if not self.can_allocate(num_pages):
            raise InvariantViolation(f"{owner}: {num_pages} pages > {self.num_free_pages}")
        if num_pages > len(self.free_page_ids):
            self._merge_and_sort_free()
        page_ids = [self.free_page_ids.popleft() for _ in range(num_pages)]
        for page_id in page_ids:
            if self.owners[page_id] is not None:
                raise InvariantViolation(f"page {page_id} handed out twice")
            self.owners[page_id] = owner
            self.generations[page_id] += 1
        return page_ids

    def free(self, page_ids: Iterable[int], owner: str) -> None:
        """Return `owner`'s pages; freeing a page one does not own is a bug."""
        page_ids = list(page_ids)
        for page_id in page_ids:
            if page_id == RESERVED_PAGE:
                raise InvariantViolation("the reserved page is never freed")
            if self.owners[page_id] != owner:
                raise InvariantViolation(
                    f"page {page_id} freed by {owner}, owned by {self.owners[page_id]}"
                )
            self.owners[page_id] = None
        if self.free_order == "lifo":
            self.free_page_ids.extendleft(reversed(page_ids))
        else:
            self.release_page_ids.extend(page_ids)

    def transfer(self, page_ids: Iterable[int], owner: str, new_owner: str) -> None:
        """Hand `owner`'s pages to `new_owner` as they are (the prefix cache adopting a
        finished request's pages): no generation bump, since the KV in them stays valid."""
        for page_id in page_ids:
            if self.owners[page_id] != owner:
                raise InvariantViolation(
                    f"page {page_id} handed over by {owner}, owned by {self.owners[page_id]}"
                )
            self.owners[page_id] = new_owner

    def owned_pages(self, owner: str) -> list[int]:
        return [p for p, o in enumerate(self.owners) if o == owner]

    def check_consistent(self) -> None:
        """Every usable page is either free exactly once or owned exactly once."""
        free = [*self.free_page_ids, *self.release_page_ids]
        if len(free) != len(set(free)):
            raise InvariantViolation("a page is free twice")
        if RESERVED_PAGE in free:
            raise InvariantViolation("the reserved page is in the free list")
        for page_id in free:
            if self.owners[page_id] is not None:
                raise InvariantViolation(f"free page {page_id} has an owner")
        num_owned = sum(owner is not None for owner in self.owners)
        if num_owned + len(free) != self.num_usable_pages:
            raise InvariantViolation("a page is neither free nor owned")

    def _merge_and_sort_free(self) -> None:
        merged = sorted([*self.free_page_ids, *self.release_page_ids])
        self.free_page_ids = deque(merged)
        self.release_page_ids = []

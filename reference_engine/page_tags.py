"""Owner tags on KV bytes: which allocation wrote each page last (torch-free).

A page's tag is the allocation generation (see `allocator.PageAllocator.generations`) of the
request that wrote it. Writers stamp the generation they were given when they got the page;
a reader owns a page's bytes only if the tag equals its own generation. A write that lands
after the page was freed and handed out again (a stale writer) stamps an old generation, and
a page nobody wrote since reallocation keeps the previous owner's tag: both show as mismatches.

The tags are kept always (stamping is cheap); only the `page_tags` fix makes decode check them.
"""

from __future__ import annotations

from collections.abc import Sequence


class PageTags:
    def __init__(self, num_pages: int) -> None:
        self.tags = [0] * num_pages

    def stamp(self, page_ids: Sequence[int], generations: Sequence[int]) -> None:
        for page_id, generation in zip(page_ids, generations, strict=True):
            self.tags[page_id] = generation

    def first_mismatch(self, page_ids: Sequence[int], generations: Sequence[int]) -> int | None:
        """The first page whose bytes were not written by this allocation, if any."""
        for page_id, generation in zip(page_ids, generations, strict=True):
            if self.tags[page_id] != generation:
                return page_id
        return None

"""The prefill side's prefix cache: a page-granular radix tree of finished prompts' KV pages.

SGLang's RadixCache with `page_size > 1`, in small. Each node is one full page: its edge is
the page's `page_size` token ids, its value the pool page holding their KV. A path from a
root spells a token prefix a page at a time, so a match is always page-aligned. There is
one tree per namespace: requests in different namespaces never share a node, whatever their
tokens (SGLang's `extra_key` / `cache_salt`, vLLM's salted first-block hash). Which
namespace a request belongs to is the scheduler's policy (the `cache_salt` and
`derive_cache_salt` fix switches); to this module a namespace is any hashable value.

Life of a page:

    match()    a new request finds its longest cached prefix, touching the path (LRU)
    lock()     it holds the path while it runs: a locked node is never evicted; locking a
               node locks every ancestor, so an unlocked node has no locked descendant
    insert()   a finished request's full prompt pages join the tree; the pages the tree did
               not have are *adopted* (the caller hands their ownership to the cache), those
               it already had are duplicates the caller frees. Aborted requests are never
               inserted (SGLang #28374): their KV may be incomplete
    unlock()   the request is done with the path
    evict()    pages are needed: unlocked leaves go, least recently used first, and a parent
               left childless becomes a leaf in turn; the caller frees the returned pages

What it deliberately does not know: the allocator, KV bytes, torch, or requests. It returns
page ids and the caller does every allocator operation, so ownership stays in one place.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from kvcanary.reference_engine.invariants import InvariantViolation

Namespace = Hashable
_ROOT_PAGE = -1


@dataclass(eq=False, slots=True)
class CacheNode:
    """One cached page: its tokens (the edge from its parent) and the pool page with their KV."""

    tokens: tuple[int, ...]
    page_id: int
    parent: CacheNode | None
    children: dict[tuple[int, ...], CacheNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


class PrefixCache:
    """Page-granular radix trees, one per namespace, over one pool's pages."""

    def __init__(self, page_size: int) -> None:
        assert page_size >= 1, page_size
        self.page_size = page_size
        self._roots: dict[Namespace, CacheNode] = {}
        self._clock = itertools.count(1)
        self.num_pages = 0
        """Pages the cache holds (owns in the pool)."""

    # ---- lookup ---------------------------------------------------------------------------

    def match(
        self, namespace: Namespace, token_ids: Sequence[int], max_pages: int
    ) -> list[CacheNode]:
        """The nodes of the longest cached page-aligned prefix of `token_ids`, at most
        `max_pages` pages (the caller keeps at least one token to compute)."""
        node = self._roots.get(namespace)
        path: list[CacheNode] = []
        if node is None:
            return path
        now = next(self._clock)
        for k in range(min(max_pages, len(token_ids) // self.page_size)):
            child = node.children.get(self._page(token_ids, k))
            if child is None:
                break
            child.last_access = now
            path.append(child)
            node = child
        return path

    def lock(self, path: Sequence[CacheNode]) -> None:
        for node in path:
            node.lock_ref += 1

    def unlock(self, path: Sequence[CacheNode]) -> None:
        for node in path:
            if node.lock_ref <= 0:  # a real check: it stops the side (-O keeps it)
                raise InvariantViolation(f"page {node.page_id} unlocked more often than locked")
            node.lock_ref -= 1

    # ---- insertion and eviction ---------------------------------------------------------

    def insert(
        self, namespace: Namespace, token_ids: Sequence[int], page_ids: Sequence[int]
    ) -> list[int]:
        """Cache the full pages of a finished prompt; returns the page ids the cache adopted."""
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = CacheNode((), _ROOT_PAGE, None)
        now = next(self._clock)
        adopted: list[int] = []
        for k in range(min(len(token_ids) // self.page_size, len(page_ids))):
            tokens = self._page(token_ids, k)
            child = node.children.get(tokens)
            if child is None:
                child = node.children[tokens] = CacheNode(tokens, page_ids[k], node)
                adopted.append(page_ids[k])
                self.num_pages += 1
            child.last_access = now
            node = child
        return adopted

    def evict(self, num_pages: int) -> list[int]:
        """Drop up to `num_pages` unlocked pages, least recently used leaves first."""
        tie = itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self._nodes() if _evictable_leaf(n)]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens]
            freed.append(node.page_id)
            self.num_pages -= 1
            if parent.parent is not None and _evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        self._roots = {ns: root for ns, root in self._roots.items() if root.children}
        return freed

    @property
    def num_evictable_pages(self) -> int:
        """Pages `evict` could free now: every unlocked node (its subtree is unlocked too)."""
        return sum(1 for node in self._nodes() if node.lock_ref == 0)

    def page_ids(self) -> list[int]:
        return [node.page_id for node in self._nodes()]

    def check_consistent(self) -> None:
        """Every node's page is distinct and counted; locks never exceed the parent's."""
        nodes = list(self._nodes())
        pages = [n.page_id for n in nodes]
        assert len(pages) == len(set(pages)) == self.num_pages, "a page is cached twice"
        for node in nodes:
            assert len(node.tokens) == self.page_size
            parent = node.parent
            assert parent is not None
            assert parent.children[node.tokens] is node
            if parent.parent is not None:
                assert node.lock_ref <= parent.lock_ref, "a locked node has an unlocked parent"

    # ---- helpers --------------------------------------------------------------------------

    def _page(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        return tuple(token_ids[k * self.page_size : (k + 1) * self.page_size])

    def _nodes(self) -> Iterator[CacheNode]:
        """Every non-root node, depth first."""
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _evictable_leaf(node: CacheNode) -> bool:
    return not node.children and node.lock_ref == 0

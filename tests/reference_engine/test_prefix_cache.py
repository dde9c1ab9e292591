"""The page-granular radix cache on its own: matching, namespaces, locks, LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary.reference_engine.invariants import InvariantViolation
from kvcanary.reference_engine.prefix_cache import PrefixCache

P = 4


def tokens(*pages: int, tail: int = 0) -> list[int]:
    """Whole pages whose tokens are all `page` (distinct values: distinct pages), then a tail."""
    return [t for page in pages for t in [page] * P] + [99] * tail


def test_a_finished_prompt_is_matched_page_by_page() -> None:
    cache = PrefixCache(P)
    assert cache.insert(None, tokens(1, 2, 3, tail=2), [10, 11, 12, 13]) == [10, 11, 12]

    path = cache.match(None, tokens(1, 2, 7), max_pages=8)
    assert [n.page_id for n in path] == [10, 11]
    assert [n.page_id for n in cache.match(None, tokens(1, 2, 3), max_pages=2)] == [10, 11]
    assert cache.match(None, tokens(2, 1), max_pages=8) == []
    # a partial last page is never a match
    assert [n.page_id for n in cache.match(None, [*tokens(1), 2, 2], max_pages=8)] == [10]
    assert cache.num_pages == 3


def test_namespaces_never_share_a_page() -> None:
    cache = PrefixCache(P)
    cache.insert(("tenant-a", None), tokens(1, 2), [10, 11])

    assert cache.match(("tenant-b", None), tokens(1, 2), max_pages=8) == []
    assert cache.match(None, tokens(1, 2), max_pages=8) == []
    assert len(cache.match(("tenant-a", None), tokens(1, 2), max_pages=8)) == 2
    assert cache.insert(("tenant-b", None), tokens(1, 2), [20, 21]) == [20, 21]
    assert cache.num_pages == 4


def test_pages_the_tree_already_has_are_not_adopted() -> None:
    cache = PrefixCache(P)
    cache.insert(None, tokens(1, 2), [10, 11])

    # a request that matched page 10 and computed the rest: 10 is the tree's, 30 a duplicate
    assert cache.insert(None, tokens(1, 2, 3), [10, 30, 31]) == [31]
    assert sorted(cache.page_ids()) == [10, 11, 31]
    assert [n.page_id for n in cache.match(None, tokens(1, 2, 3), 8)] == [10, 11, 31]


def test_locked_paths_survive_eviction_and_leaves_go_least_recent_first() -> None:
    cache = PrefixCache(P)
    cache.insert(None, tokens(1, 2, 3), [10, 11, 12])
    cache.insert(None, tokens(1, 5), [10, 15])
    cache.insert(None, tokens(6), [16])
    cache.match(None, tokens(1, 5), 8)  # touch 10 -> 15: most recent
    held = cache.match(None, tokens(6), 8)
    cache.lock(held)

    assert cache.num_evictable_pages == 4
    assert cache.evict(1) == [12]  # the least recently used leaf
    assert cache.evict(10) == [11, 15, 10]  # 10 becomes a leaf once its children are gone
    assert cache.page_ids() == [16]
    cache.unlock(held)
    assert cache.evict(10) == [16]
    assert cache.num_pages == 0
    assert cache.match(None, tokens(6), 8) == []


def test_locking_a_path_locks_its_ancestors_children_first_never_evicted() -> None:
    cache = PrefixCache(P)
    cache.insert(None, tokens(1, 2), [10, 11])
    path = cache.match(None, tokens(1, 2), 8)
    cache.lock(path)
    cache.check_consistent()

    assert cache.evict(5) == []
    cache.unlock(path[1:])
    assert cache.evict(5) == [11]
    cache.unlock(path[:1])
    assert cache.evict(5) == [10]


def test_unlocking_more_often_than_locking_is_a_real_check() -> None:
    cache = PrefixCache(P)
    cache.insert(None, tokens(1), [10])
    path = cache.match(None, tokens(1), 8)
    cache.lock(path)
    cache.unlock(path)
    with pytest.raises(InvariantViolation, match="page 10 unlocked more often than locked"):
        cache.unlock(path)  # an InvariantViolation stops the side; -O keeps it


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "match_lock", "unlock", "evict"]),
            st.lists(st.integers(0, 2), min_size=0, max_size=4),
            st.integers(0, 1),
            st.integers(1, 3),
        ),
        max_size=40,
    )
)
def test_random_operations_keep_the_tree_consistent(
    ops: list[tuple[str, list[int], int, int]],
) -> None:
    """Pages are unique, locks nest, evicted pages were unlocked and are gone for good."""
    cache = PrefixCache(P)
    next_page = iter(range(1, 10_000))
    held: list[list[int]] = []
    locked_paths = []
    for op, pages, namespace, count in ops:
        ids = tokens(*pages)
        if op == "insert":
            page_ids = [next(next_page) for _ in pages]
            adopted = cache.insert(namespace, ids, page_ids)
            assert set(adopted) <= set(page_ids)
        elif op == "match_lock":
            path = cache.match(namespace, ids, max_pages=len(pages))
            assert all(len(n.tokens) == P for n in path)
            assert [t for n in path for t in n.tokens] == ids[: len(path) * P]
            cache.lock(path)
            locked_paths.append(path)
            held.append([n.page_id for n in path])
        elif op == "unlock" and locked_paths:
            cache.unlock(locked_paths.pop(0))
            held.pop(0)
        elif op == "evict":
            freed = cache.evict(count)
            assert len(freed) <= count
            assert not set(freed) & {p for path in held for p in path}
            assert not set(freed) & set(cache.page_ids())
        cache.check_consistent()

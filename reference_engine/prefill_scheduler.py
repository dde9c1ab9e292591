"""Prefill-side queues and decisions (torch-free): SGLang's disaggregation/prefill.py, in small.

Life of a request on the prefill side:

    add()              intake: the scheduler's `validate_input_length`; the vulnerable path
                       swaps the prompt for the one-token placeholder and defers the 400, the
                       `admission_retire` fix finishes it with the 400 here; then the bootstrap
                       queue's own capacity check, which sees whatever the prompt now is
    bootstrap queue    waits for decode's metadata (KVPoll Bootstrapping -> WaitingForInput)
    waiting queue      chunked prefill, one chunk per step, pages allocated at the first chunk
    inflight           the sender is writing pages to decode; finished when it concludes

What it deliberately does not know: tensors, the event loop, or the transfer backend. The
prefill server (`prefill.py`) drives it and runs the model chunks it schedules.

The prefix cache (`config.prefix_cache`, `prefix_cache.PrefixCache`): `schedule()` matches
the longest cached page-aligned prefix (at most all but the last token, which must be computed
to sample), locks it, puts its pages first in the block table and starts prefill past them, so
a hit skips that compute for real; `release()` of a *successful* request inserts its full
prompt pages (the cache adopts those it lacked) and frees the rest. Aborted and rejected
requests are never inserted (SGLang #28374). When pages run short, unlocked cached pages are
evicted, least recently used first. The namespace a request's pages live in:

    (tenant_key if derive_cache_salt else None, cache_salt if cache_salt else None)

so with neither fix every tenant shares one tree (the timing side channel), with `cache_salt`
the client's salt separates them (and a client can send another tenant's salt), and with
`derive_cache_salt` the credential does (a body salt then only subdivides a tenant's cache).
"""

from __future__ import annotations

import logging
import math
from collections import deque

from kvcanary.reference_engine import finish
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.finish import FinishAbort
from kvcanary.reference_engine.interfaces import KVPoll, TransferMetadata
from kvcanary.reference_engine.prefix_cache import CacheNode, PrefixCache
from kvcanary.reference_engine.sequence import Req
from kvcanary.reference_engine.side_base import SchedulerBase, ZeroPages

logger = logging.getLogger(__name__)

CACHE_OWNER = "prefix-cache"
"""The allocator owner of every page the prefix cache holds."""


class PrefillScheduler(SchedulerBase):
    def __init__(self, config: EngineConfig, zero_pages: ZeroPages | None = None) -> None:
        super().__init__(config, config.prefill_pool_tokens, zero_pages)
        self.bootstrap_queue: dict[str, Req] = {}
        self.waiting_queue: deque[Req] = deque()
        self.inflight_queue: dict[str, Req] = {}
        self.cache = PrefixCache(self.page_size) if config.prefix_cache else None
        self._cache_paths: dict[str, list[CacheNode]] = {}
        """The cached path each running request holds locked, by request id."""

    # ---- intake ---------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Admit `req` to the bootstrap queue, or finish it with its rejection."""
        if not self._admit_input_length(req):
            return
        over_capacity = self.limits.check_capacity(req.rid, req.num_prompt_tokens)
        if over_capacity is not None:
            req.finish_abort(over_capacity)
            return
        req.max_new_tokens = 1  # prefill samples the first token only (SGLang's _process_req)
        req.poll = KVPoll.BOOTSTRAPPING
        self.bootstrap_queue[req.rid] = req

    def on_bootstrapped(self, req: Req, meta: TransferMetadata) -> None:
        """Decode's metadata arrived: the request may be prefilled (WaitingForInput)."""
        assert self.bootstrap_queue.pop(req.rid) is req
        req.dst_page_ids = meta.dst_page_ids
        req.poll = KVPoll.WAITING_FOR_INPUT
        self.waiting_queue.append(req)

    # ---- chunked prefill ------------------------------------------------------------------

    def schedule(self) -> tuple[Req, int, int] | None:
        """The next chunk to prefill, (req, start, end), allocating pages at the first chunk."""
        if not self.waiting_queue:
            return None
        req = self.waiting_queue[0]
        if not req.page_ids and not self._allocate(req):
            return None
        start = req.num_computed_tokens
        end = min(start + self.config.prefill_chunk_tokens, req.num_prompt_tokens)
        return req, start, end

    def _allocate(self, req: Req) -> bool:
        """Pages for the whole prompt: the cached prefix's first (shared), then new ones."""
        path = self._match(req)
        num_new = math.ceil(req.num_prompt_tokens / self.page_size) - len(path)
        if not self._make_room(num_new):
            self._unlock(req)
            return False
        req.page_ids = [n.page_id for n in path] + self.allocator.allocate(num_new, req.rid)
        req.page_generations = [self.allocator.generations[p] for p in req.page_ids]
        req.num_cached_tokens = req.num_computed_tokens = len(path) * self.page_size
        req.num_ready_pages = len(path)
        return True

    def _match(self, req: Req) -> list[CacheNode]:
        if self.cache is None or req.to_finish is not None:
            return []
        max_pages = (req.num_prompt_tokens - 1) // self.page_size  # the last token is computed
        path = self.cache.match(self.namespace(req), req.origin_input_ids, max_pages)
        self.cache.lock(path)
        self._cache_paths[req.rid] = path
        return path

    def _unlock(self, req: Req) -> list[CacheNode]:
        path = self._cache_paths.pop(req.rid, [])
        if self.cache is not None:
            self.cache.unlock(path)
        return path

    def _make_room(self, num_pages: int) -> bool:
        shortfall = num_pages - self.allocator.num_free_pages
        if shortfall > 0 and self.cache is not None:
            self._free(self.cache.evict(shortfall), CACHE_OWNER)
        return self.allocator.can_allocate(num_pages)

    def namespace(self, req: Req) -> tuple[str | None, str | None]:
        """The prefix-cache tree `req` reads and writes (see the module docstring)."""
        tenant = req.tenant_key if self.config.has("derive_cache_salt") else None
        salt = req.cache_salt if self.config.has("cache_salt") else None
        return tenant, salt

    def on_chunk_done(self, req: Req, end: int, token: int | None) -> None:
        """Record progress: complete pages may now be sent; the last chunk sampled a token."""
        req.num_computed_tokens = end
        if end < req.num_prompt_tokens:
            req.num_ready_pages = end // self.page_size
            return
        assert token is not None
        req.num_ready_pages = len(req.page_ids)
        req.output_ids = [token]
        assert self.waiting_queue.popleft() is req
        self.inflight_queue[req.rid] = req

    def num_pages_to_send(self, req: Req) -> int:
        """SGLang's sender: min(len(src), len(dst)); only a short *destination* is noticed."""
        num_src = math.ceil(req.num_prompt_tokens / self.page_size)
        num_dst = len(req.dst_page_ids)
        if num_src > num_dst:
            logger.warning("%s: %d source pages > %d destination pages", req.rid, num_src, num_dst)
        return min(num_src, num_dst)

    def prefill_done(self, req: Req) -> bool:
        return req.rid in self.inflight_queue

    # ---- endings --------------------------------------------------------------------------

    def finish_success(self, req: Req) -> None:
        """Transfer Success: FINISH_LENGTH, whatever the deferred `to_finish` said (#33507)."""
        req.poll = KVPoll.SUCCESS
        req.finish(
            finish.finished_length(
                req.num_prompt_tokens, len(req.output_ids), req.num_cached_tokens
            )
        )
        self.release(req, insert=req.to_finish is None)

    def finish_failed(self, req: Req, abort: FinishAbort) -> None:
        if not req.is_finished:
            req.finish_abort(abort)
        self.release(req)

    def remove(self, req: Req) -> None:
        """Take `req` out of whichever queue holds it (its pages stay until `release`)."""
        self.bootstrap_queue.pop(req.rid, None)
        self.inflight_queue.pop(req.rid, None)
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)

    def release(self, req: Req, *, insert: bool = False) -> None:
        """Free `req`'s pages; with `insert`, its full prompt pages join the prefix cache."""
        self.remove(req)
        own = req.page_ids[len(self._cache_paths.get(req.rid, ())) :]
        if insert and self.cache is not None and req.page_ids:
            ns = self.namespace(req)
            adopted = set(self.cache.insert(ns, req.origin_input_ids, req.page_ids))
            self.allocator.transfer(adopted, req.rid, CACHE_OWNER)
            own = [p for p in own if p not in adopted]
        self._unlock(req)
        if own:
            self._free(own, req.rid)
        req.page_ids = []

    @property
    def num_cached_pages(self) -> int:
        return 0 if self.cache is None else self.cache.num_pages

    def find(self, rid: str) -> Req | None:
        if rid in self.bootstrap_queue:
            return self.bootstrap_queue[rid]
        if rid in self.inflight_queue:
            return self.inflight_queue[rid]
        return next((r for r in self.waiting_queue if r.rid == rid), None)

    @property
    def num_queued(self) -> int:
        return len(self.bootstrap_queue) + len(self.waiting_queue)

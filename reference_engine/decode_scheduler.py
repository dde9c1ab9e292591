"""Decode-side queues and decisions (torch-free): SGLang's disaggregation/decode.py, in small.

Life of a request on the decode side:

    add()              intake with decode's *own* limits (its pool is usually larger than
                       prefill's, so the incident's prompt passes here), then the prealloc
                       queue's capacity check
    prealloc queue     waits for budget; `pop_preallocated` reserves pages for decode's own
                       view of the prompt (plus room for the tokens to come) and hands the
                       request to the server, which publishes the page list to prefill
    transfer queue     waits for prefill's status; `commit` checks it. Vulnerable: only the
                       bootstrap room. Fixes add coverage, checksum and page-tag checks
    running batch      continuous batching: committed requests join the next decode step

What it deliberately does not know: tensors, the event loop, the transfer backend. Checksums
are computed by a callable the server passes in; page tags live in `PageTags`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from kvcanary.reference_engine import finish
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.finish import FinishAbort
from kvcanary.reference_engine.interfaces import KVPoll
from kvcanary.reference_engine.invariants import InvariantViolation
from kvcanary.reference_engine.page_tags import PageTags
from kvcanary.reference_engine.sequence import Req
from kvcanary.reference_engine.side_base import SchedulerBase, ZeroPages

Checksum = Callable[[Sequence[int]], int]


class DecodeScheduler(SchedulerBase):
    def __init__(self, config: EngineConfig, zero_pages: ZeroPages | None = None) -> None:
        super().__init__(config, config.decode_pool_tokens, zero_pages)
        self.tags = PageTags(self.num_pages)
        self.prealloc_queue: deque[Req] = deque()
        self.transfer_queue: dict[str, Req] = {}
        self.running: list[Req] = []
        self.num_reserved_pages = 0

    # ---- intake and preallocation ---------------------------------------------------------

    def add(self, req: Req) -> None:
        if not self._admit_input_length(req):
            return
        # deviation: SGLang checks the input alone and retracts under pressure; counting the
        # new tokens too means an admitted request always fits (no retraction needed)
        over = self.limits.check_capacity(req.rid, req.num_prompt_tokens + req.max_new_tokens)
        if over is not None:
            req.finish_abort(over)
            return
        req.poll = KVPoll.BOOTSTRAPPING
        self.prealloc_queue.append(req)

    def pop_preallocated(self) -> list[Req]:
        """Reserve pages, in arrival order, for as many queued requests as the budget allows."""
        admitted: list[Req] = []
        while self.prealloc_queue and self._num_active < self.config.max_running_requests:
            req = self.prealloc_queue[0]
            num_prompt_pages = self._pages(req.num_prompt_tokens)
            num_total_pages = self._pages(req.num_prompt_tokens + req.max_new_tokens)
            budget = self.allocator.num_free_pages - self.num_reserved_pages
            if num_total_pages > budget:
                break
            self.prealloc_queue.popleft()
            req.page_ids = self.allocator.allocate(num_prompt_pages, req.rid)
            req.page_generations = [self.allocator.generations[p] for p in req.page_ids]
            req.num_reserved_pages = num_total_pages - num_prompt_pages
            self.num_reserved_pages += req.num_reserved_pages
            req.poll = KVPoll.WAITING_FOR_INPUT
            self.transfer_queue[req.rid] = req
            admitted.append(req)
        return admitted

    # ---- commit ---------------------------------------------------------------------------

    def pop_transferred(self) -> list[Req]:
        """Requests whose transfer status has arrived, in arrival order."""
        done = [r for r in self.transfer_queue.values() if r.transfer_status is not None]
        for req in done:
            del self.transfer_queue[req.rid]
        return done

    def commit(self, req: Req, checksum: Checksum) -> None:
        """`_commit_transfer_to_req`: check the status, then join the running batch."""
        problem = self._commit_problem(req, checksum)
        if problem is not None:
            self._end(req, problem)
            return
        assert req.transfer_status is not None
        assert req.transfer_status.first_token_id is not None
        req.output_ids.append(req.transfer_status.first_token_id)
        req.num_cached_tokens = req.transfer_status.num_cached_tokens
        req.poll = KVPoll.SUCCESS
        if len(req.output_ids) >= req.max_new_tokens:
            self._finish_length(req)
        else:
            self.running.append(req)

    def _commit_problem(self, req: Req, checksum: Checksum) -> FinishAbort | None:
        status = req.transfer_status
        assert status is not None
        if status.rejected:
            return finish.rejected_by_prefill(req.rid)
        if status.poll != KVPoll.SUCCESS or status.first_token_id is None:
            return finish.transfer_failed(req.rid, req.room)
        if status.room != req.room:
            return finish.room_mismatch()
        if self.config.has("coverage_check") and status.num_tokens_written != req.num_prompt_tokens:
            return finish.coverage_mismatch(
                req.rid, status.num_tokens_written, req.num_prompt_tokens
            )
        # SGLang #39500 skips the comparison when prefill published no checksum
        checksum_on = self.config.has("kv_checksum") and status.checksum is not None
        if checksum_on and status.checksum != checksum(req.page_ids):
            return finish.checksum_mismatch(req.rid)
        if self.config.has("page_tags"):
            problem = self._tag_problem(req)
            if problem is not None:
                return problem
        return req.to_finish  # decode's own deferred intake rejection surfaces here

    def _tag_problem(self, req: Req) -> FinishAbort | None:
        page_id = self.tags.first_mismatch(req.page_ids, req.page_generations)
        return None if page_id is None else finish.page_tag_mismatch(req.rid, page_id)

    # ---- decode steps ---------------------------------------------------------------------

    def schedule_decode(self) -> tuple[list[Req], list[Req]]:
        """The next step's batch, each request with a stamped page for its new token.

        Also returns the requests ended on the way (a `page_tags` mismatch on read).
        """
        ended: list[Req] = []
        for req in list(self.running):
            # Check before stamping: the page this step writes into may hold a late write
            # from an aborted request, which a fresh stamp would hide (`kvcanary verify`).
            problem = self._tag_problem(req) if self.config.has("page_tags") else None
            if problem is not None:
                self.running.remove(req)
                self._end(req, problem)
                ended.append(req)
                continue
            self._ensure_page(req)
        return list(self.running), ended

    def _ensure_page(self, req: Req) -> None:
        """The page for the token this step writes, taken from the reservation if new."""
        index = (req.num_tokens - 1) // self.page_size
        if index == len(req.page_ids):
            if req.num_reserved_pages <= 0:  # a real check: it stops the side (-O keeps it)
                raise InvariantViolation(f"{req.rid} outgrew its page reservation")
            page_id = self.allocator.allocate(1, req.rid)[0]
            req.page_ids.append(page_id)
            req.page_generations.append(self.allocator.generations[page_id])
            req.num_reserved_pages -= 1
            self.num_reserved_pages -= 1
        self.tags.stamp([req.page_ids[index]], [req.page_generations[index]])

    def on_decoded(self, reqs: Sequence[Req], tokens: Sequence[int]) -> None:
        for req, token in zip(reqs, tokens, strict=True):
            req.output_ids.append(token)
            if len(req.output_ids) >= req.max_new_tokens:
                self.running.remove(req)
                self._finish_length(req)

    # ---- endings --------------------------------------------------------------------------

    def abort(self, rid: str, abort: FinishAbort) -> Req | None:
        """Finish a live request with `abort`; its pages stay until `release` (see the server)."""
        req = self.find(rid)
        if req is None:
            return None
        if req in self.prealloc_queue:
            self.prealloc_queue.remove(req)
        self.transfer_queue.pop(rid, None)
        if req in self.running:
            self.running.remove(req)
        req.finish_abort(abort)
        return req

    def release(self, req: Req) -> None:
        """Return the request's pages and unused reservation to the pool."""
        if req.page_ids:
            self._free(req.page_ids, req.rid)
            req.page_ids = []
        self.num_reserved_pages -= req.num_reserved_pages
        req.num_reserved_pages = 0

    def find(self, rid: str) -> Req | None:
        if rid in self.transfer_queue:
            return self.transfer_queue[rid]
        for req in (*self.prealloc_queue, *self.running):
            if req.rid == rid:
                return req
        return None

    def _finish_length(self, req: Req) -> None:
        req.finish(
            finish.finished_length(
                req.num_prompt_tokens, len(req.output_ids), req.num_cached_tokens
            )
        )
        self.release(req)

    def _end(self, req: Req, abort: FinishAbort) -> None:
        req.finish_abort(abort)
        self.release(req)

    def _pages(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    @property
    def _num_active(self) -> int:
        return len(self.transfer_queue) + len(self.running)

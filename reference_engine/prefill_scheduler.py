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

Seam for a prefix cache (a radix cache keyed by cache salt and tokens comes later; there is
none now, as with SGLang's --disable-radix-cache): `schedule()` is where a request gets its
pages and its first uncomputed token, so a cache would match a page-aligned prefix there,
reuse those pages and start at `num_computed_tokens` past them; `release()` is where finished
pages would be inserted instead of freed (never an aborted request's, SGLang #28374). The
salt arrives in `GenerateRequest.cache_salt` / `tenant_key`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence

from reference_engine import finish
from reference_engine.allocator import PageAllocator
from reference_engine.config import EngineConfig
from reference_engine.finish import FinishAbort
from reference_engine.interfaces import KVPoll, TransferMetadata
from reference_engine.limits import SideLimits
from reference_engine.sequence import Req

logger = logging.getLogger(__name__)


class PrefillScheduler:
    def __init__(
        self,
        config: EngineConfig,
        zero_pages: Callable[[Sequence[int]], None] | None = None,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.limits = SideLimits.of(config, config.prefill_pool_tokens)
        self.allocator = PageAllocator(
            config.prefill_pool_tokens // config.page_size + 1, config.free_order
        )
        self._zero_pages = zero_pages if config.has("zero_on_free") else None
        self.bootstrap_queue: dict[str, Req] = {}
        self.waiting_queue: deque[Req] = deque()
        self.inflight_queue: dict[str, Req] = {}

    # ---- intake ---------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Admit `req` to the bootstrap queue, or finish it with its rejection."""
        rejection = self.limits.validate_input_length(req.num_prompt_tokens)
        if rejection is not None:
            if self.config.has("admission_retire"):
                req.finish_abort(rejection)
                return
            req.set_finish_with_abort(rejection)
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
        if not req.page_ids:
            num_pages = math.ceil(req.num_prompt_tokens / self.page_size)
            if not self.allocator.can_allocate(num_pages):
                return None
            req.page_ids = self.allocator.allocate(num_pages, req.rid)
            req.page_generations = [self.allocator.generations[p] for p in req.page_ids]
        start = req.num_computed_tokens
        end = min(start + self.config.prefill_chunk_tokens, req.num_prompt_tokens)
        return req, start, end

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
        req.finish(finish.finished_length(req.num_prompt_tokens, len(req.output_ids)))
        self.release(req)

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

    def release(self, req: Req) -> None:
        self.remove(req)
        if req.page_ids:
            if self._zero_pages is not None:
                self._zero_pages(req.page_ids)
            self.allocator.free(req.page_ids, req.rid)
            req.page_ids = []

    def find(self, rid: str) -> Req | None:
        if rid in self.bootstrap_queue:
            return self.bootstrap_queue[rid]
        if rid in self.inflight_queue:
            return self.inflight_queue[rid]
        return next((r for r in self.waiting_queue if r.rid == rid), None)

    @property
    def num_queued(self) -> int:
        return len(self.bootstrap_queue) + len(self.waiting_queue)

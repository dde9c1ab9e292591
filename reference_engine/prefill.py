"""The prefill server: admits, prefills in chunks, sends KV pages, answers with its own view.

Concurrency: one asyncio scheduler loop runs the torch work inline, one prefill chunk
(`prefill_chunk_tokens`) per step, then yields (`await asyncio.sleep(0)`), so the event loop
is never held for longer than a chunk. Per request, a bootstrap task waits for decode's
metadata and a sender task writes pages as chunks complete (`transfer_chunk_pages` per
`send_pages`), checking between chunks whether decode cancelled. Pages are released only after
the sender concluded (SGLang frees prefill KV after the transfer), so nothing is read from a
freed page.

With `prefix_cache`, a request whose prompt starts with cached pages prefills only the rest
(the scheduler puts the cached pages first in its block table); all its pages are still
sent, and `TransferStatus.num_cached_tokens` tells decode how many were cached, for usage.

The vulnerable success path reports what SGLang's does (#33507): FINISH_LENGTH, HTTP 200 and
`prompt_tokens` of the placeholder (1), whatever the deferred 400 said. What this module
does not decide: admission and queue order (`prefill_scheduler`), the model (`model_runner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Iterable
from typing import Any

from kvcanary.reference_engine import finish
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.finish import FinishAbort
from kvcanary.reference_engine.interfaces import (
    FinishOut,
    GenerateRequest,
    KVPoll,
    PageChunk,
    TransferBackend,
    TransferStatus,
)
from kvcanary.reference_engine.model_runner import ModelRunner
from kvcanary.reference_engine.prefill_scheduler import CACHE_OWNER, PrefillScheduler
from kvcanary.reference_engine.sequence import Req
from kvcanary.reference_engine.side_base import SideBase

logger = logging.getLogger(__name__)

_BOOTSTRAP_POLL_S = 0.05
"""How often a bootstrapping request re-checks whether decode cancelled the room."""


class PrefillServer(SideBase):
    mode = "prefill"

    def __init__(self, config: EngineConfig, transfer: TransferBackend, runner: ModelRunner):
        super().__init__(config, runner.model.vocab_size)
        self.transfer = transfer
        self.runner = runner
        self.scheduler = PrefillScheduler(config, runner.zero_pages)
        self.allocator = self.scheduler.allocator
        self.limits = self.scheduler.limits
        self._answers: dict[str, asyncio.Future[FinishOut]] = {}
        self._progress: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._aborts: dict[str, FinishAbort] = {}
        self._reqs: dict[str, Req] = {}
        """Every request with a task here: what may hold pages (`live_requests`)."""

    # ---- PrefillSide ----------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> FinishOut:
        r = self.admit(req, self._answers, self.scheduler.add)
        if r.is_finished:  # tell decode now (SGLang #38704's before-send failure notice)
            assert r.finished is not None
            rejected = r.finished.status == 400  # a client error, not an engine failure
            await self.transfer.conclude(TransferStatus(r.room, KVPoll.FAILED, rejected=rejected))
            return r.finished
        answer = asyncio.get_running_loop().create_future()
        self._answers[r.rid] = answer
        self._reqs[r.rid] = r
        self._progress[r.rid] = asyncio.Event()
        self._tasks[r.rid] = asyncio.create_task(self._serve(r), name=f"prefill-{r.rid}")
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            await self.abort(r.rid)
            raise

    async def abort(self, rid: str) -> None:
        """Client gone: stop at the next chunk boundary; pages go when the sender has stopped."""
        req = self.scheduler.find(rid)
        if req is None or rid in self._aborts:
            return
        self._aborts[rid] = finish.client_aborted(rid)
        if req in self.scheduler.waiting_queue:
            self.scheduler.remove(req)  # no more chunks; the sender will see the abort
        self._progress[rid].set()

    async def stop(self) -> None:
        await super().stop()
        tasks = list(self._tasks.values())
        self.fail_all(None)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def fail_all(self, abort: FinishAbort | None) -> None:
        for rid, task in self._tasks.items():
            self._aborts.setdefault(rid, abort or finish.engine_stopped(rid))
            task.cancel()

    # ---- per request ----------------------------------------------------------------------

    async def _serve(self, req: Req) -> None:
        """Bootstrap, then send pages as prefill produces them; conclude; release; answer."""
        try:
            meta_ok = await self._bootstrap(req)
            status = await self._send(req) if meta_ok else None
        except asyncio.CancelledError:
            status = None
            self._aborts.setdefault(req.rid, finish.engine_stopped(req.rid))
        if status is None:
            status = TransferStatus(req.room, KVPoll.FAILED, aborted=req.rid in self._aborts)
        try:
            await self.transfer.conclude(status)
        except Exception:  # decode may be gone; this side still has to answer and release
            logger.warning("%s: could not conclude room %d", req.rid, req.room, exc_info=True)
        try:
            if status.poll == KVPoll.SUCCESS:
                self.scheduler.finish_success(req)
            else:
                if req.rid not in self._aborts:  # decode gave up on the transfer
                    self.counters["num_transfer_failed_reqs_total"] += 1
                abort = self._aborts.get(req.rid) or finish.transfer_failed(req.rid, req.room)
                self.scheduler.finish_failed(req, abort)
        except Exception as exc:  # the bookkeeping broke: the side dies, the client is answered
            self.die(exc)
        self._done(req)

    async def _bootstrap(self, req: Req) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.bootstrap_timeout_s
        while req.rid not in self._aborts and not await self.transfer.is_cancelled(req.room):
            remaining = deadline - loop.time()
            if remaining <= 0:
                self._aborts[req.rid] = finish.bootstrap_timeout(req.rid, req.room)
                self.counters["num_bootstrap_failed_reqs_total"] += 1
                return False
            meta = await self.transfer.wait_for_metadata(
                req.room, min(remaining, _BOOTSTRAP_POLL_S)
            )
            if meta is not None and req.rid not in self._aborts:
                self.scheduler.on_bootstrapped(req, meta)
                self.wake()
                return True
        return False

    async def _send(self, req: Req) -> TransferStatus | None:
        """Send ready pages in chunks; None if cancelled or aborted on the way."""
        progress = self._progress[req.rid]
        num_to_send = self.scheduler.num_pages_to_send(req)
        num_sent = 0
        while True:
            if req.rid in self._aborts or await self.transfer.is_cancelled(req.room):
                return None
            num_ready = min(req.num_ready_pages, num_to_send)
            if num_sent < num_ready:
                num_pages = min(self.config.transfer_chunk_pages, num_ready - num_sent)
                await self._send_chunk(req, num_sent, num_pages)
                num_sent += num_pages
            elif self.scheduler.prefill_done(req) and num_sent == num_to_send:
                return self._success(req, num_sent)
            else:
                await progress.wait()
                progress.clear()

    async def _send_chunk(self, req: Req, first_page: int, num_pages: int) -> None:
        req.poll = KVPoll.TRANSFERRING
        payload = self.runner.read_pages(req.page_ids[first_page : first_page + num_pages])
        await self.transfer.send_pages(PageChunk(req.room, first_page, num_pages, payload))

    def _success(self, req: Req, num_sent: int) -> TransferStatus:
        sent_pages = req.page_ids[:num_sent]
        return TransferStatus(
            room=req.room,
            poll=KVPoll.SUCCESS,
            first_token_id=req.output_ids[0],
            num_tokens_written=(
                min(req.num_prompt_tokens, num_sent * self.config.page_size)
                if self.config.has("coverage_check")
                else None
            ),
            checksum=self.runner.checksum(sent_pages) if self.config.has("kv_checksum") else None,
            num_cached_tokens=req.num_cached_tokens,
        )

    def _done(self, req: Req) -> None:
        result = req.finished or self.crash_abort().finish_out(req.num_prompt_tokens)
        self._tasks.pop(req.rid, None)
        self._progress.pop(req.rid, None)
        self._aborts.pop(req.rid, None)
        self._reqs.pop(req.rid, None)
        answer = self._answers.pop(req.rid)
        if not answer.done():
            answer.set_result(result)
        self.wake()  # pages came back: the waiting head may fit now

    # ---- the scheduler loop ---------------------------------------------------------------

    async def step(self) -> bool:
        """Run one prefill chunk, if one can be scheduled."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return False
        req, start, end = scheduled
        token = self.runner.prefill_chunk(req, start, end)
        self.scheduler.on_chunk_done(req, end, token)
        self._progress[req.rid].set()
        return True

    # ---- introspection --------------------------------------------------------------------

    def live_requests(self) -> Iterable[Req]:
        return self._reqs.values()

    def shared_page_owners(self) -> Collection[str]:
        return (CACHE_OWNER,) if self.scheduler.cache is not None else ()

    def queue_sizes(self) -> dict[str, int]:
        return {
            "num_bootstrap_queue_reqs": len(self.scheduler.bootstrap_queue),
            "num_waiting_reqs": len(self.scheduler.waiting_queue),
            "num_inflight_reqs": len(self.scheduler.inflight_queue),
        }

    def extra_info(self) -> dict[str, Any]:
        return {"prefill_chunk_tokens": self.config.prefill_chunk_tokens}

    def num_allocated_pages(self) -> int:
        """Pages owned by requests: the prefix cache's own pages are not a request's."""
        return self.allocator.num_allocated_pages - self.scheduler.num_cached_pages

    def server_info(self) -> dict[str, Any]:
        info = super().server_info()
        info["disable_radix_cache"] = not self.config.prefix_cache  # SGLang's field
        info["internal_states"][0]["num_cached_pages"] = self.scheduler.num_cached_pages
        return info

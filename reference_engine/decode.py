"""The decode server: preallocates, receives KV, commits, decodes; its answer reaches the client.

Concurrency: one asyncio scheduler loop; each step publishes new reservations to prefill,
commits arrived transfers and runs one decode step of the running batch (the torch work,
inline), then yields. A per-request task waits for the room's transfer status. Received pages
are written by the transfer backend through a per-request `PageSink`, which stamps the
request's owner tags.

Aborts (client disconnect) are where page lifetime matters. A request whose transfer may still
be in flight has its pages freed at once in the vulnerable engine, so a late write from its
prefill lands in whoever gets them next; with `deferred_release` (SGLang #35049) the pages are
held until prefill acknowledges the drain (`wait_drained`) or `release_timeout_s` passes.

A client can abort mid-transfer only if it has a response to drop: once decode has published
a request's reservation, `generate` yields `HeadOut` and the HTTP layer sends a stream's head
then, before the first token, as SGLang streams do. Where a switch can still refuse the
request when it commits (`HEAD_AFTER_COMMIT`), the head waits for the commit instead, so that
the refusal stays an HTTP status rather than an error event after a 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Coroutine, Iterable, Sequence
from typing import Any

from kvcanary.reference_engine import finish
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.decode_scheduler import DecodeScheduler
from kvcanary.reference_engine.finish import FinishAbort
from kvcanary.reference_engine.interfaces import (
    FinishOut,
    GenerateRequest,
    HeadOut,
    KVPoll,
    SideEvent,
    TokenOut,
    TransferBackend,
    TransferMetadata,
)
from kvcanary.reference_engine.model_runner import ModelRunner
from kvcanary.reference_engine.page_tags import PageTags
from kvcanary.reference_engine.sequence import Req
from kvcanary.reference_engine.side_base import SideBase
from kvcanary.reference_engine.tokenizer import Detokenizer, Tokenizer

logger = logging.getLogger(__name__)
HEAD_AFTER_COMMIT = frozenset({"admission_retire", "coverage_check", "kv_checksum", "page_tags"})
"""Switches whose commit can refuse a request that decode took on (prefill's rejection, a
coverage, checksum or tag mismatch): with any on, a stream's head waits for the commit."""


class RequestSink:
    """Decode's pool as one request's transfer sees it: writes stamp that request's tags."""

    def __init__(self, runner: ModelRunner, tags: PageTags, req: Req) -> None:
        self._runner, self._tags = runner, tags
        self._generations = dict(zip(req.page_ids, req.page_generations, strict=True))

    def write_pages(self, page_ids: tuple[int, ...], payload: bytes) -> None:
        self._runner.write_pages(page_ids, payload)
        self._tags.stamp(page_ids, [self._generations[p] for p in page_ids])


class DecodeServer(SideBase):
    mode = "decode"

    def __init__(
        self,
        config: EngineConfig,
        transfer: TransferBackend,
        runner: ModelRunner,
        tokenizer: Tokenizer,
    ) -> None:
        super().__init__(config, runner.model.vocab_size)
        self.transfer = transfer
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = DecodeScheduler(config, runner.zero_pages)
        self.allocator = self.scheduler.allocator
        self.limits = self.scheduler.limits
        self._live: dict[str, Req] = {}
        self._outputs: dict[str, asyncio.Queue[SideEvent]] = {}
        self._detokenizers: dict[str, Detokenizer] = {}
        self._num_emitted: dict[str, int] = {}
        self._status_tasks: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._held: dict[str, Req] = {}
        """Aborted requests whose pages wait for prefill's drain ack (`deferred_release`)."""
        self._early_head = not (config.fixes & HEAD_AFTER_COMMIT)

    # ---- DecodeSide -----------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[SideEvent, None]:
        r = self.admit(req, self._live, self.scheduler.add)
        if r.finished is not None:
            await self.transfer.cancel_receiver(r.room)  # prefill stops waiting for metadata
            yield r.finished
            return
        outputs: asyncio.Queue[SideEvent] = asyncio.Queue()
        self._live[r.rid], self._outputs[r.rid] = r, outputs
        self._detokenizers[r.rid], self._num_emitted[r.rid] = Detokenizer.of(self.tokenizer), 0
        self.wake()
        finished = False
        try:
            while not finished:
                event = await outputs.get()
                finished = isinstance(event, FinishOut)
                yield event
        finally:
            if not finished:  # the consumer went away: a client disconnect
                self._abort_now(r.rid, finish.client_aborted(r.rid))
            self._forget(r.rid)

    async def abort(self, rid: str) -> None:
        self._abort_now(rid, finish.client_aborted(rid))
        await asyncio.sleep(0)  # let the cancel notice reach the transfer backend

    async def stop(self) -> None:
        await super().stop()
        self.fail_all(None)
        background = list(self._background)
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def fail_all(self, abort: FinishAbort | None) -> None:
        for rid in list(self._live):
            ending = abort or finish.engine_stopped(rid)
            try:
                self._abort_now(rid, ending)
            except Exception:  # broken bookkeeping: the request is still answered
                logger.exception("%s: aborting it raised; answering it directly", rid)
                self._answer_now(rid, ending)

    def _answer_now(self, rid: str, ending: FinishAbort) -> None:
        req, outputs = self._live.pop(rid, None), self._outputs.pop(rid, None)
        if req is not None and outputs is not None:
            outputs.put_nowait(ending.finish_out(req.num_prompt_tokens, len(req.output_ids)))

    # ---- the scheduler loop ---------------------------------------------------------------

    async def step(self) -> bool:
        progressed = False
        for req in self.scheduler.pop_preallocated():
            await self._register(req)
            progressed = True
        for req in self.scheduler.pop_transferred():
            self.scheduler.commit(req, self.runner.checksum)
            if req.poll == KVPoll.FAILED:
                self.counters["num_transfer_failed_reqs_total"] += 1
            self._emit(req)
            progressed = True
        batch, ended = self.scheduler.schedule_decode()
        for req in ended:
            self._emit(req)
        if batch:
            tokens = self.runner.decode_step(batch)
            self.scheduler.on_decoded(batch, tokens)
            for req in batch:
                self._emit(req)
            progressed = True
        return progressed

    async def _register(self, req: Req) -> None:
        """Publish the reservation to prefill (SGLang's send_metadata), then await the status."""
        meta = TransferMetadata(req.room, tuple(req.page_ids), req.num_prompt_tokens)
        req.registered = True  # from here on a write may be in flight
        await self.transfer.register_receiver(
            meta, RequestSink(self.runner, self.scheduler.tags, req)
        )
        if not req.is_finished:
            task = asyncio.create_task(self._await_status(req), name=f"status-{req.rid}")
            self._status_tasks[req.rid] = task
            outputs = self._outputs.get(req.rid)
            if self._early_head and req.to_finish is None and outputs is not None:
                outputs.put_nowait(HeadOut())  # only a failed transfer can refuse it now

    async def _await_status(self, req: Req) -> None:
        status = await self.transfer.receiver_status(req.room)
        self._status_tasks.pop(req.rid, None)
        if not req.is_finished:
            req.transfer_status = status
            self.wake()

    # ---- aborts and page lifetime ---------------------------------------------------------

    def _abort_now(self, rid: str, abort: FinishAbort) -> None:
        """Finish `rid` now; free or hold its pages depending on a possible in-flight write."""
        req = self.scheduler.abort(rid, abort)
        if req is None:
            return
        status_task = self._status_tasks.pop(rid, None)
        if status_task is not None:
            status_task.cancel()
        self._emit(req)
        in_flight = req.registered and req.transfer_status is None
        if in_flight and self.config.has("deferred_release"):
            self._held[req.rid] = req
            self._spawn(self._release_after_drain(req))
            return
        self.scheduler.release(req)  # vulnerable if in flight: prefill may still write here
        if in_flight or not req.registered:
            self._spawn(self.transfer.cancel_receiver(req.room))
        self.wake()

    async def _release_after_drain(self, req: Req) -> None:
        try:
            await self.transfer.cancel_receiver(req.room)
            async with asyncio.timeout(self.config.release_timeout_s):
                await self.transfer.wait_drained(req.room)
        except TimeoutError:
            logger.warning(
                "%s: no drain ack after %.1fs; releasing", req.rid, self.config.release_timeout_s
            )
        finally:
            self._held.pop(req.rid, None)
            self.scheduler.release(req)
            self.wake()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- output ---------------------------------------------------------------------------

    def _emit(self, req: Req) -> None:
        """Queue the request's new tokens and, once, its finish."""
        outputs = self._outputs.get(req.rid)
        if outputs is None:
            return
        new_ids: Sequence[int] = req.output_ids[self._num_emitted[req.rid] :]
        detokenizer = self._detokenizers[req.rid]
        for token_id in new_ids:
            outputs.put_nowait(TokenOut(token_id, detokenizer.step(token_id)))
        self._num_emitted[req.rid] += len(new_ids)
        self.counters["generation_tokens_total"] += len(new_ids)
        if req.finished is not None:
            outputs.put_nowait(req.finished)
            self._live.pop(req.rid, None)
            self._outputs.pop(req.rid, None)

    def _forget(self, rid: str) -> None:
        self._live.pop(rid, None)
        self._outputs.pop(rid, None)
        self._detokenizers.pop(rid, None)
        self._num_emitted.pop(rid, None)

    # ---- introspection --------------------------------------------------------------------

    def has_background_work(self) -> bool:
        """Whether aborts are still notifying prefill or waiting for a drain."""
        return bool(self._background)

    def live_requests(self) -> Iterable[Req]:
        s = self.scheduler
        return [*s.prealloc_queue, *s.transfer_queue.values(), *s.running, *self._held.values()]

    def queue_sizes(self) -> dict[str, int]:
        return {
            "num_prealloc_queue_reqs": len(self.scheduler.prealloc_queue),
            "num_transfer_queue_reqs": len(self.scheduler.transfer_queue),
            "num_running_reqs": len(self.scheduler.running),
        }

"""What the prefill and decode sides share: the servers' scheduler loop, intake layer 1 and
introspection (`SideBase`), and their schedulers' pool bookkeeping (`SchedulerBase`).

The loop runs `step()` (a bounded amount of torch work, done inline), yields to the event loop
after every step, and sleeps on a wake event when there is nothing to do. Every
`PAGE_CHECK_EVERY_STEPS` steps, and each time it goes idle, it checks the side's page
bookkeeping (`invariants`: pool accounting, ownership, lost pages).

Failing loudly: if a step raises, or a page check fails, the loop logs one clear line
(`<mode> scheduler loop stopped: ...`), fails every live request with a 500 and stops. From
then on the side is dead, not quietly stuck: `health_problem()` says why (the app answers
`/health` with 503) and `admit()` fails every new request at once with a 500.
`server_info()` and `metrics_snapshot()` use SGLang's field and metric names.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Collection, Container, Iterable, Sequence
from typing import Any

from kvcanary.reference_engine import finish
from kvcanary.reference_engine.allocator import PageAllocator
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.finish import FinishAbort
from kvcanary.reference_engine.interfaces import GenerateRequest
from kvcanary.reference_engine.invariants import InvariantViolation, LiveRequest, check_side_pages
from kvcanary.reference_engine.limits import SideLimits
from kvcanary.reference_engine.sequence import Req

logger = logging.getLogger(__name__)

PAGE_CHECK_EVERY_STEPS = 64
"""How often a busy loop checks its page bookkeeping (an idle one checks each time)."""

ZeroPages = Callable[[Sequence[int]], None]
"""The model runner's page zeroing, called with the ids of freed pages (`zero_on_free`)."""

_COUNTERS = (
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_bootstrap_failed_reqs_total",
    "num_transfer_failed_reqs_total",
)


class SchedulerBase:
    """A side's pool as its scheduler sees it: limits, the page allocator, zero_on_free.

    Torch-free, like the schedulers built on it; `zero_pages` is the model runner's, called
    before freed pages go back to the pool when the `zero_on_free` fix is on."""

    def __init__(
        self, config: EngineConfig, pool_tokens: int, zero_pages: ZeroPages | None = None
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.limits = SideLimits.of(config, pool_tokens)
        self.num_pages = pool_tokens // config.page_size + 1  # + the reserved page 0
        self.allocator = PageAllocator(self.num_pages, config.free_order)
        self._zero_pages = zero_pages if config.has("zero_on_free") else None

    def _admit_input_length(self, req: Req) -> bool:
        """This side's own input limit (SGLang's `validate_input_length`). Over it, the request
        is retired at once under `admission_retire` (False), or, in the vulnerable engine, its
        prompt swapped for the one-token placeholder and its 400 deferred (True: it goes on)."""
        rejection = self.limits.validate_input_length(req.num_prompt_tokens)
        if rejection is None:
            return True
        if self.config.has("admission_retire"):
            req.finish_abort(rejection)
            return False
        req.set_finish_with_abort(rejection)
        return True

    def _free(self, page_ids: Sequence[int], owner: str) -> None:
        """Return `owner`'s pages to the pool (zeroed first under zero_on_free)."""
        if page_ids and self._zero_pages is not None:
            self._zero_pages(page_ids)
        self.allocator.free(page_ids, owner)


class SideBase(abc.ABC):
    mode: str
    allocator: PageAllocator
    limits: SideLimits

    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.counters: Counter[str] = Counter(dict.fromkeys(_COUNTERS, 0))
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.crash: Exception | None = None
        """What stopped the scheduler loop, if a step or a page check raised."""
        self._num_steps = 0

    # ---- the loop -------------------------------------------------------------------------

    @abc.abstractmethod
    async def step(self) -> bool:
        """Do one bounded piece of work; False when there was nothing to do."""

    @abc.abstractmethod
    def fail_all(self, abort: FinishAbort | None) -> None:
        """Finish every live request with `abort` (None: the engine is stopping)."""

    def wake(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        assert self._loop_task is None, f"{self.mode} side started twice"
        self._loop_task = asyncio.create_task(self._run(), name=f"{self.mode}-scheduler")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None

    async def _run(self) -> None:
        try:
            while True:
                if await self.step():
                    self._num_steps += 1
                    if self._num_steps % PAGE_CHECK_EVERY_STEPS == 0:
                        self.check_pages()
                    await asyncio.sleep(0)
                    continue
                self.check_pages()
                await self._wake.wait()
                self._wake.clear()
        except Exception as exc:
            self.die(exc)

    def die(self, exc: Exception) -> None:
        """Stop serving: log why, remember it, fail every live request with a 500."""
        if self.crash is not None:
            return
        self.crash = exc
        if isinstance(exc, InvariantViolation):
            logger.error(
                "%s scheduler loop stopped: page bookkeeping is wrong: %s; failing every "
                "request with 500, /health answers 503",
                self.mode,
                exc,
            )
        else:
            logger.error(
                "%s scheduler loop stopped: step raised %r; failing every request with 500, "
                "/health answers 503",
                self.mode,
                exc,
                exc_info=exc,
            )
        try:
            self.fail_all(self.crash_abort())
        except Exception:  # the bookkeeping may be what broke: requests still get answers
            logger.exception("%s: failing the live requests raised", self.mode)
        loop_task = self._loop_task
        if loop_task is not None and loop_task is not asyncio.current_task():
            loop_task.cancel()  # died outside the loop (a request's task): stop the loop too

    def crash_abort(self) -> FinishAbort:
        return finish.internal_error(f"{self.mode} scheduler loop stopped: {self.crash!r}")

    def health_problem(self) -> str | None:
        """Why the side cannot serve (None: healthy): its scheduler loop is not running."""
        if self.crash is not None:
            return f"{self.mode} scheduler loop stopped: {self.crash!r}"
        if self._loop_task is None or self._loop_task.done():
            return f"{self.mode} scheduler loop is not running"
        return None

    # ---- page bookkeeping -----------------------------------------------------------------

    @abc.abstractmethod
    def live_requests(self) -> Iterable[LiveRequest]:
        """Every request that may hold pages of this side's pool now."""

    def shared_page_owners(self) -> Collection[str]:
        """Allocator owners that hold pages without being a request (a prefix cache)."""
        return ()

    def check_pages(self) -> None:
        """Raise `InvariantViolation` if the pool's accounting or a page's owner is wrong."""
        check_side_pages(self.allocator, self.live_requests(), self.shared_page_owners())

    # ---- intake, layer 1 ------------------------------------------------------------------

    def admit(
        self, request: GenerateRequest, live: Container[str], queue: Callable[[Req], None]
    ) -> Req:
        """Intake on either side: count, validate, then `queue` it or finish it rejected.

        `live` holds the ids of requests still running here (a duplicate is refused).
        """
        req = Req.from_request(request)
        self.counters["prompt_tokens_total"] += req.num_client_tokens
        if self.crash is not None:  # a dead side answers at once instead of queueing
            req.finish_abort(self.crash_abort())
            return req
        rejection = self.intake_rejection(req)
        if rejection is None and req.rid in live:
            rejection = finish.duplicate_rid(req.rid)
        if rejection is None:
            queue(req)
        else:
            req.finish_abort(rejection)
        return req

    def intake_rejection(self, req: Req) -> FinishAbort | None:
        """TokenizerManager's checks: token ids in the vocabulary, the context length."""
        if req.max_new_tokens < 1:
            return finish.bad_request(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if not req.origin_input_ids:
            return finish.bad_request("The input is empty.")
        bad = next((t for t in req.origin_input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return finish.bad_request(f"Token id {bad} is out of vocabulary range")
        return self.limits.check_context(req.num_prompt_tokens, req.max_new_tokens)

    # ---- introspection --------------------------------------------------------------------

    def num_allocated_pages(self) -> int:
        return self.allocator.num_allocated_pages

    @abc.abstractmethod
    def queue_sizes(self) -> dict[str, int]: ...

    def server_info(self) -> dict[str, Any]:
        state = {
            "max_total_num_tokens": self.limits.pool_tokens,
            "max_req_input_len": self.limits.max_req_input_len,
            "num_allocated_pages": self.num_allocated_pages(),
            **self.queue_sizes(),
        }
        return {
            "kvcanary_reference_engine": True,
            "status": "ready",
            "disaggregation_mode": self.mode,
            "context_length": self.config.context_length,
            "page_size": self.config.page_size,
            "max_total_num_tokens": self.limits.pool_tokens,
            "max_req_input_len": self.limits.max_req_input_len,
            "preset": self.config.preset,
            "fixes": sorted(self.config.fixes),
            "free_order": self.config.free_order,
            "device": self.config.device,
            "internal_states": [state],
        }

    def metrics_snapshot(self) -> dict[str, float]:
        num_used = self.allocator.num_allocated_pages * self.config.page_size
        sizes = self.queue_sizes()
        return {
            "token_usage": num_used / self.limits.pool_tokens,
            "num_used_tokens": float(num_used),
            "max_total_num_tokens": float(self.limits.pool_tokens),
            "num_running_reqs": float(sizes.get("num_running_reqs", 0)),
            "num_queue_reqs": float(sum(v for k, v in sizes.items() if k != "num_running_reqs")),
            **{name: float(value) for name, value in self.counters.items()},
        }

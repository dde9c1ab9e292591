"""What the prefill and decode servers share: the scheduler loop, intake layer 1, introspection.

The loop runs `step()` (a bounded amount of torch work, done inline), yields to the event loop
after every step, and sleeps on a wake event when there is nothing to do. If a step raises,
the loop logs it, fails every live request with a 500 and stops, so callers get an answer
instead of hanging. `server_info()` and `metrics_snapshot()` use SGLang's field and metric names.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Container
from typing import Any

from reference_engine import finish
from reference_engine.allocator import PageAllocator
from reference_engine.config import EngineConfig
from reference_engine.finish import FinishAbort
from reference_engine.interfaces import GenerateRequest
from reference_engine.limits import SideLimits
from reference_engine.sequence import Req

logger = logging.getLogger(__name__)

_COUNTERS = (
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_bootstrap_failed_reqs_total",
    "num_transfer_failed_reqs_total",
)


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
        """What stopped the scheduler loop, if a step raised."""

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
                    await asyncio.sleep(0)
                    continue
                await self._wake.wait()
                self._wake.clear()
        except Exception as exc:
            logger.exception("%s scheduler loop crashed", self.mode)
            self.crash = exc
            self.fail_all(finish.internal_error(f"{self.mode} scheduler crashed: {exc!r}"))

    # ---- intake, layer 1 ------------------------------------------------------------------

    def admit(
        self, request: GenerateRequest, live: Container[str], queue: Callable[[Req], None]
    ) -> Req:
        """Intake on either side: count, validate, then `queue` it or finish it rejected.

        `live` holds the ids of requests still running here (a duplicate is refused).
        """
        req = Req.from_request(request)
        self.counters["prompt_tokens_total"] += req.num_client_tokens
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

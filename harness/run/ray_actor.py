"""A tenant's Ray actor (`--ray`): it builds, sends and scans the plans the driver draws for
its tenant, and hands back what the driver journals, in batches.

The driver calls `exchange` with the plans it drew for this tenant since the last call
(sketches, or plans built where the prompts cannot be built here) and the requests it
cancelled; the actor starts them and answers with every request done since its last
answer. An answer waits for at least one request to end, then for as many as the driver
asked (`batch`: three quarters of the requests it has out here, at most
`harness.run.ray_sender.ANSWER_BATCH`) or `LINGER_S`, whichever is first: so a closed loop
of one request waits for no timer, and a busy actor answers for many requests per Ray call
(a call costs the driver hundreds of microseconds of CPU, whatever it carries). A newer
exchange releases a waiting one: the driver sends newly drawn plans without waiting for the
previous answer (`harness.run.ray_sender`).

`lookup` answers another actor's question about fragments it could not place
(`canaries.elsewhere`). An actor restarted by Ray (`MAX_RESTARTS`) starts without the
requests and canaries its predecessor had; `instance` tells the driver so.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvcanary.canaries import Owner
from kvcanary.canaries.elsewhere import live_holding
from kvcanary.harness.run.ray_kit import ActorKit, RunSecrets, Sent, Sketch, TenantRun
from kvcanary.tenants.plan import RequestPlan

LINGER_S = 0.05
"""The longest a done request waits for others to share its answer."""
MAX_PARKED = 2
"""Exchanges kept waiting at most: a third releases the oldest, so newly drawn plans never
wait for a slow request to end (`harness.run.ray_sender.MAX_EXCHANGES` is one more)."""
Done = Sent | tuple[str, BaseException]
Exchange = tuple[list[tuple[int, Sketch | RequestPlan]], list[str], int, int, int]
"""What an exchange carries but the secrets and the peers: the plans, the requests cancelled,
the canaries live elsewhere, the driver's clock now, the answer's batch (`exchange`)."""
Answer = tuple[str, int, int, list[Done]]
"""The actor's instance, how many canaries its index holds live, how many requests it was
given and has not answered for (in flight, or done since this answer was made), and each
request done: what `TenantRun.send` reports, or (its id, the exception that ended it)."""


class TenantWorker:
    """One tenant's actor: see the module docstring."""

    def __init__(self, kit: ActorKit) -> None:
        self._kit = kit
        self.instance = uuid.uuid4().hex
        self._run: TenantRun | None = None
        self._peers: Sequence[Any] = ()
        self._running: dict[str, asyncio.Task[None]] = {}
        self._done: list[Done] = []
        self._batch = 1
        self._parked: deque[asyncio.Future[list[Done]]] = deque()
        """Exchanges waiting for their answer, oldest first."""
        self._linger: asyncio.TimerHandle | None = None

    def pid(self) -> int:
        """The actor's process (tests kill it to lose a worker mid-run)."""
        return os.getpid()

    async def exchange(
        self, request: bytes, secrets: RunSecrets, peers: Sequence[Any] | None
    ) -> bytes:
        """`request` (an `Exchange`, pickled: Ray serialises one bytes argument and one bytes
        answer for far less than their parts) done; the `Answer`, pickled. `secrets` travel
        as their own small argument, always inline in the call (a large argument would go
        through Ray's object store, which may spill to disk); `peers`: the other actors,
        given once (None: as before; handles cost Ray bookkeeping each time they travel)."""
        plans, cancelled, live_elsewhere, driver_now_ns, batch = pickle.loads(request)
        answer = await self._exchange(
            plans, cancelled, secrets, peers, live_elsewhere, driver_now_ns, batch
        )
        return pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)

    async def _exchange(
        self,
        plans: Sequence[tuple[int, Sketch | RequestPlan]],
        cancelled: Sequence[str],
        secrets: RunSecrets,
        peers: Sequence[Any] | None,
        live_elsewhere: int,
        driver_now_ns: int,
        batch: int,
    ) -> Answer:
        """Start `plans` ((scheduled time on the driver's clock, sketch or plan) each), cancel the
        requests `cancelled`, and answer with the requests done (the module docstring).
        `live_elsewhere`: the canaries live in the other actors' indexes; `batch`: how many
        requests done make an answer due."""
        offset_ns = driver_now_ns - time.perf_counter_ns()  # the driver's clock minus ours
        self._batch = batch
        run = self._run_for(secrets)
        if peers is not None:
            self._peers = peers
        run.peers = self._peers
        run.index.live_elsewhere(live_elsewhere)
        for request_id in cancelled:
            task = self._running.get(request_id)
            if task is not None:
                task.cancel()
        built = run.built([plan for _, plan in plans])  # a plan that cannot be built: no start
        for (t_scheduled_ns, _), plan in zip(plans, built, strict=True):
            local_ns = t_scheduled_ns - offset_ns
            coroutine = self._request(run, plan, local_ns, offset_ns, secrets)
            self._running[plan.request_id] = asyncio.get_running_loop().create_task(coroutine)
        done = await self._answer()
        # the requests done meanwhile wait in `_done` for the next answer: still unanswered
        unanswered = len(self._running) + len(self._done)
        return self.instance, len(run.index), unanswered, done

    def lookup(self, kgrams: list[str]) -> list[tuple[str, Owner]]:
        """The canaries live here holding any of `kgrams`, with their owners."""
        return [] if self._run is None else live_holding(self._run.index, kgrams)

    def _run_for(self, secrets: RunSecrets) -> TenantRun:
        if self._run is None or self._run.key != secrets.key:
            self._run = TenantRun(self._kit, secrets)
        return self._run

    async def _request(
        self,
        run: TenantRun,
        plan: RequestPlan,
        t_scheduled_ns: int,
        offset_ns: int,
        secrets: RunSecrets,
    ) -> None:
        try:
            sent = await run.send(plan, t_scheduled_ns, offset_ns, secrets)
            self._done.append(sent)  # the list of now: an answer takes it away meanwhile
        except asyncio.CancelledError:
            pass  # the driver cancelled it and journaled it so: nothing to answer
        except Exception as exc:  # the driver's run ends on it, as a local one would
            self._done.append((plan.request_id, exc))
        finally:
            self._running.pop(plan.request_id, None)
            self._check()

    async def _answer(self) -> list[Done]:
        """This exchange's answer, once due (the module docstring)."""
        if len(self._parked) >= MAX_PARKED:
            self._release()  # the oldest goes with what is done: room for this one
        waiter: asyncio.Future[list[Done]] = asyncio.get_running_loop().create_future()
        self._parked.append(waiter)
        self._check()
        return await waiter

    def _check(self) -> None:
        """Release the oldest exchange when an answer is due; else start the linger."""
        if not self._parked:
            return
        num_done = len(self._done)
        if num_done >= self._batch:
            self._release()
        elif num_done and self._linger is None:
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, self._release)

    def _release(self) -> None:
        """The oldest exchange answers with every request done so far."""
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        while self._parked:
            waiter = self._parked.popleft()
            if not waiter.done():  # not cancelled
                waiter.set_result(self._done)
                self._done = []
                return

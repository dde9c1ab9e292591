"""`--ray`: each tenant's requests built, sent and scanned by its own Ray actor; the driver
keeps the schedule, the journal and the verdict.

What runs where:

    driver   the schedule: which tenant sends what size when (the planner's draws, as
             sketches: `Planner.sketch`), the pacing, the cost guard; the journal (the
             lines the actors encoded, written as they come back); the timing and protocol
             detectors and the target's health (a few microseconds a request); the verdict
    actors   one per tenant (`harness.run.ray_actor.TenantWorker`), on whichever node Ray
             places it, each with its own HTTP client, clock, planner and live index of its
             tenant's canaries: it builds each plan's prompt (the same prompt the driver
             would build: the same settings, seed and key), sends it, scans the response,
             redacts it and encodes the plan's and the observation's journal lines

A canary found whole attributes itself with the run key, wherever it is found. A fragment
(words of a canary without its tag) needs the live canaries, and another tenant's are in
another actor: an actor asks the others about the runs of canary words its index cannot
place and scans the response again with what they name (`canaries.elsewhere`), so the
findings are those of one process (tested: the same seed against a deterministic target,
with and without `--ray`, gives the same findings). The fragment rule's count of live
canaries is the whole run's: the driver passes each actor the others' counts.

Batching: a Ray call costs the driver hundreds of microseconds of CPU whatever it carries,
so each actor's plans and answers travel in batches (`TenantWorker.exchange`): the plans
drawn since the last call go with the next one, sent as soon as no call is out (after
`GATHER_S`, so the plans replacing those just answered go together), or after
`DISPATCH_WAIT_S` beside one; the answer carries every request done meanwhile. With many
requests in flight the driver's CPU per request is under 100 µs (`benchmarks/bench_ray.py`);
with one, a request costs a Ray call of its own.

Clocks: an actor stamps its observation with its own `perf_counter_ns`, so TTFT and every
other difference within one request is exact on the node that sent it; it shifts the
timestamps onto the driver's clock by the offset between the two clocks when the plan
reached it (`ray_kit.rebased`), so the time a plan travels to its actor is not in
`queue_ns`, and the time it waited for its batch is.

Failures: an actor that dies mid-request (its node lost, its process killed) ends the
requests it had in flight as observations with `error_kind="worker_lost"` (their plans
built here, as they were there); Ray restarts the actor (`MAX_RESTARTS`), so the tenant's
later requests are sent by the new one (which starts with an empty index: fragments of its
predecessor's canaries go unseen, whole ones are still attributed). A plan that cannot be
built, or any other error in an actor, ends the run as it would in one process. Ctrl-C's
cancellations reach the actors with the next exchange.

Credentials and the run key: each exchange hands the actor the run's canary key, its
tenant's credential headers (resolved here, for that call) and every tenant's credential
values (scrubbed from what the target sends back) as one small argument of the call
(`RunSecrets`), which the actor keeps in memory only. Never through Ray's `runtime_env`:
Ray writes a runtime env in clear into its own logs (`session_*/logs/
runtime_env_agent.log`, readable by anyone on the node), and the cluster's nodes need not
have the variables at all. The actors are made with what is not secret (`ActorKit`).

The cluster is connected (`harness.run.ray_cluster`) before the run writes anything or
sends a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pickle
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcanary.harness.run.ray_actor import Answer, Exchange, TenantWorker
from kvcanary.harness.run.ray_cluster import import_ray
from kvcanary.harness.run.ray_kit import (
    ActorKit,
    ClientSpec,
    RunSecrets,
    Sketch,
    draw_of,
    sketch_of,
)
from kvcanary.harness.run.seams import Executed, unanswered
from kvcanary.harness.run.settle import journaled_form
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.planner import LOCAL_TOKENIZERS, Planner
from kvcanary.tenants.tenant import Tenant, all_secrets

if TYPE_CHECKING:
    from kvcanary.harness.run.assembly import Assembly

MAX_RESTARTS = 3
"""How often Ray brings a dead tenant actor back before its requests fail for good."""
ACTOR_PREFIX = "kvcanary-"
"""Actors are named `kvcanary-<tenant>-<8 hex>` on the cluster, so an operator can find them."""
DISPATCH_WAIT_S = 0.05
"""How long newly drawn plans wait for the exchange out to come back before going in a
second one beside it..."""
DISPATCH_BATCH = 32
"""...or until this many wait."""
GATHER_S = 0.002
"""How long newly drawn plans wait to go together when no exchange is out but requests are
(the runner draws the plans replacing those an answer carried over a few turns of its loop)."""
ANSWER_BATCH = 64
"""An answer is due once three quarters of the requests out to the actor are done, up to
this many (at ~1.5 KB a request, an answer under Ray's 100 KB for passing a value in the
call itself). Fewer, larger answers: a Ray call costs the driver ~700 µs of CPU."""
MAX_EXCHANGES = 3
"""Exchanges out to one actor at a time, at most."""
Waiting = tuple[RequestPlan, int, "asyncio.Future[Executed]"]
"""A plan, its scheduled time (this process's clock) and the runner's future for it."""


@dataclass(slots=True, eq=False)
class _Lane:
    """One actor as the driver sees it: plans waiting to go, requests out, exchanges out."""

    tenant: Tenant
    actor: Any
    peers: list[Any] = field(default_factory=list)
    pending: list[Waiting] = field(default_factory=list)
    out: dict[str, tuple[Waiting, int]] = field(default_factory=dict)
    """Requests sent, by id, with the number of the exchange that carried them."""
    cancelled: list[str] = field(default_factory=list)
    num_exchanges: int = 0
    """Exchanges out now."""
    sequence: int = 0
    answered: dict[int, str] = field(default_factory=dict)
    """The instance that answered each exchange still carrying requests out."""
    instance: str | None = None
    """The actor's instance now, as far as its answers tell."""
    dead: set[str] = field(default_factory=set)
    """Instances known gone (a newer one answered, or a call to them failed)."""
    peered: str | None = None
    """The instance an exchange with the peers' handles reached."""
    num_live: int = 0
    """Canaries live in the actor's index, as its last answer said."""
    flush: asyncio.Handle | None = None
    flush_now: bool = False


class RaySender:
    """The runner's `RemoteSender` over tenant actors: see the module docstring."""

    def __init__(
        self,
        actors: Mapping[str, Any],
        tenants: Sequence[Tenant],
        planner: Planner,
        key: bytes,
        *,
        builds_plans: bool,
        keep_raw_evidence: bool = False,
        earlier_keys: tuple[bytes, ...] = (),
    ) -> None:
        by_name = {tenant.name: tenant for tenant in tenants}
        self.actors = dict(actors)
        """Actor handle by tenant name."""
        self._lanes = {name: _Lane(by_name[name], actor) for name, actor in actors.items()}
        for lane in self._lanes.values():
            lane.peers = [other.actor for other in self._lanes.values() if other is not lane]
        self._planner, self._key = planner, key
        self._builds_plans = builds_plans
        self._keep_raw_evidence = keep_raw_evidence
        self._earlier_keys = earlier_keys
        self._secrets = all_secrets(tenants)
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_exchanges = 0
        """Exchanges made so far (the benchmark's count of Ray calls)."""

    @property
    def builds_plans(self) -> bool:
        """Whether the actors build the prompts (a local tokenizer), else this process."""
        return self._builds_plans

    async def execute(self, plan: RequestPlan, *, t_scheduled_ns: int) -> Executed:
        lane = self._lanes[plan.tenant]
        future: asyncio.Future[Executed] = asyncio.get_running_loop().create_future()
        lane.pending.append((plan, t_scheduled_ns, future))
        self._wake(lane)
        try:
            return await future
        except asyncio.CancelledError:
            self._forget(lane, plan.request_id)
            raise

    def built(self, plan: RequestPlan) -> RequestPlan:
        if plan.prompt:
            return plan
        return self._planner.build([draw_of(self._planner, sketch_of(plan))])[0]

    def close(self) -> None:
        """Stop waiting for the actors (the run is over)."""
        for task in self._tasks:
            task.cancel()

    # -- batches ------------------------------------------------------------------------

    def _wake(self, lane: _Lane) -> None:
        """Send what waits: now when no exchange is out (or a batch waits), soon beside one."""
        if lane.num_exchanges >= MAX_EXCHANGES:
            return
        now = lane.num_exchanges == 0 or len(lane.pending) >= DISPATCH_BATCH
        if lane.flush is not None:
            if lane.flush_now or not now:
                return
            lane.flush.cancel()
        loop = asyncio.get_running_loop()
        lane.flush_now = now
        if now and lane.out:  # the plans drawn to replace those just answered, together
            lane.flush = loop.call_later(GATHER_S, self._flush, lane)
        elif now:
            lane.flush = loop.call_soon(self._flush, lane)
        elif lane.pending or lane.cancelled:
            lane.flush = loop.call_later(DISPATCH_WAIT_S, self._flush, lane)

    def _flush(self, lane: _Lane) -> None:
        lane.flush = None
        if lane.num_exchanges >= MAX_EXCHANGES:
            return
        if not (lane.pending or lane.cancelled or (lane.out and not lane.num_exchanges)):
            return
        waiting, lane.pending = lane.pending, []
        cancelled, lane.cancelled = lane.cancelled, []
        lane.sequence += 1
        for item in waiting:
            lane.out[item[0].request_id] = (item, lane.sequence)
        lane.num_exchanges += 1
        self.num_exchanges += 1
        task = asyncio.get_running_loop().create_task(
            self._exchange(lane, lane.sequence, waiting, cancelled)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _exchange(
        self, lane: _Lane, sequence: int, waiting: list[Waiting], cancelled: list[str]
    ) -> None:
        import ray.exceptions

        plans: list[tuple[int, Sketch | RequestPlan]] = [
            (t_scheduled_ns, plan if plan.prompt else sketch_of(plan))
            for plan, t_scheduled_ns, _ in waiting
        ]
        secrets = RunSecrets(
            self._key, lane.tenant.auth_headers(), self._secrets, self._earlier_keys
        )
        elsewhere = sum(other.num_live for other in self._lanes.values() if other is not lane)
        peers = None if lane.peered is not None and lane.peered == lane.instance else lane.peers
        batch = max(1, min(ANSWER_BATCH, len(lane.out) * 3 // 4))
        request: Exchange = (plans, cancelled, elsewhere, time.perf_counter_ns(), batch)
        try:
            packed = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
            answer: Answer = pickle.loads(await lane.actor.exchange.remote(packed, secrets, peers))
        except ray.exceptions.RayActorError as exc:
            why = f"the Ray actor sending it died: {exc}"
            self._lose(lane, why, lambda carried: carried == sequence)
            if lane.instance is not None:  # it answered before: it is gone, and what it holds
                self._gone(lane, lane.instance, why)
        except ray.exceptions.RayTaskError as exc:  # the actor's own error ends the run
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            for plan, _, future in waiting:
                if lane.out.pop(plan.request_id, None) is not None and not future.done():
                    future.set_exception(cause)
        else:
            self._take(lane, sequence, answer)
            if peers is not None:
                lane.peered = answer[0]
        finally:
            lane.num_exchanges -= 1
        await asyncio.sleep(0)  # the runner's workers draw their next plans first
        if lane.pending or lane.cancelled or lane.out:
            self._wake(lane)

    def _take(self, lane: _Lane, sequence: int, answer: Answer) -> None:
        instance, lane.num_live, unanswered, done = answer
        lane.answered[sequence] = instance
        if instance != lane.instance and instance not in lane.dead:
            if lane.instance is not None:  # restarted: what its predecessor held is lost
                self._gone(lane, lane.instance, "the Ray actor sending it was restarted")
            lane.instance = instance
        for sent in done:
            entry = lane.out.pop(sent[0], None)
            if entry is None:  # cancelled meanwhile
                continue
            (plan, _, future), _ = entry
            if future.done():
                continue
            if len(sent) == 2:
                future.set_exception(sent[1])
            else:
                _, plan_line, obs, obs_line, streamed, content, echo = sent
                future.set_result(Executed(plan, obs, streamed, content, echo, plan_line, obs_line))
        if not unanswered and lane.num_exchanges == 1 and instance == lane.instance:
            # it owes nothing and no other answer is on its way: what it was given and did
            # not answer for is gone (it never is, unless the actor is broken)
            self._lose(lane, "the Ray actor sending it lost track of it", lambda _: True)
        if len(lane.answered) > 2 * MAX_EXCHANGES + len(lane.out):
            carried = {entry[1] for entry in lane.out.values()}
            lane.answered = {s: i for s, i in lane.answered.items() if s in carried}

    def _gone(self, lane: _Lane, instance: str, why: str) -> None:
        """`instance` is gone: the requests it was given and did not answer for are lost."""
        lane.dead.add(instance)
        if lane.instance == instance:
            lane.instance = None
        answered = lane.answered
        self._lose(lane, why, lambda carried: answered.get(carried) in lane.dead)

    def _lose(self, lane: _Lane, why: str, carried_by: Callable[[int], bool]) -> None:
        """The requests out whose exchange's number is `carried_by` end as `worker_lost`."""
        for request_id, ((plan, t_scheduled_ns, future), carried) in list(lane.out.items()):
            if not carried_by(carried):
                continue
            del lane.out[request_id]
            if not future.done():
                built = self.built(plan)
                obs = unanswered(built, t_scheduled_ns, time.perf_counter_ns(), "worker_lost", why)
                obs, _ = journaled_form(obs, (), (), keep_raw_evidence=self._keep_raw_evidence)
                future.set_result(Executed(built, obs))

    def _forget(self, lane: _Lane, request_id: str) -> None:
        """A request the runner cancelled: not sent, or cancelled on its actor too."""
        lane.pending = [item for item in lane.pending if item[0].request_id != request_id]
        if lane.out.pop(request_id, None) is not None:
            lane.cancelled.append(request_id)
            self._wake(lane)


@contextlib.contextmanager
def ray_sender(run: Assembly, spec: ClientSpec) -> Iterator[RaySender]:
    """A `RaySender` with one actor per tenant, on the cluster connected (`ray_cluster`)."""
    ray = import_ray()
    bp, planner = run.blueprint, run.planner
    builds = isinstance(planner.tokenizer, LOCAL_TOKENIZERS)
    earlier = [] if bp.keyring is None else [
        entry for key_id, entry in bp.keyring.entries.items() if key_id != planner.minter.key_id
    ]  # fmt: skip
    kit = ActorKit.of(
        planner, spec, tokenizer=planner.tokenizer.name if builds else None,
        keep_raw_evidence=bp.keep_raw_evidence,
        earlier=tuple(dataclasses.replace(entry, key=b"") for entry in earlier),
    )  # fmt: skip
    worker = ray.remote(max_restarts=MAX_RESTARTS, max_task_retries=0)(TenantWorker)
    actors = {
        tenant.name: worker.options(
            name=f"{ACTOR_PREFIX}{tenant.name}-{uuid.uuid4().hex[:8]}"
        ).remote(kit)
        for tenant in bp.tenants
    }
    sender = RaySender(
        actors, bp.tenants, planner, run.key, builds_plans=builds,
        keep_raw_evidence=bp.keep_raw_evidence,
        earlier_keys=tuple(entry.key for entry in earlier),
    )  # fmt: skip
    try:
        yield sender
    finally:
        sender.close()
        for actor in actors.values():
            ray.kill(actor, no_restart=True)

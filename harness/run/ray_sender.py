"""`--ray`: the tenants' requests sent from Ray actors, the rest of the run in the driver.

What runs where:

    driver   planner, canary minting, the live canary index, detectors, journal, pacing:
             the same `Runner` as in one process, so the same seed gives the same plans in
             the same order, and findings are attributed the same way
    actors   one per tenant (`TenantWorker`), each with its own HTTP client and clock, on
             whichever node Ray places it: it sends a plan and streams back every text delta
             as it arrives, then the observation

The live index never leaves the driver. Canaries are minted and indexed in one place; a
scanner needs every live canary of every tenant (10^5 of them), and keeping a copy in every
actor in step with every request would cost more than what it saves: an actor streams back
tens of tokens per request. So actors ship text, the driver scans it as it arrives, exactly
as it scans a local stream.

Clocks: an actor stamps its observation with its own `perf_counter_ns`, so TTFT and every
other difference within one request is exact on the node that sent it. The driver then
shifts the observation's timestamps onto its own clock, anchored at the scheduled time (what
the actor received as "late by N ns"); the time a plan spends travelling to its actor is
therefore not in `queue_ns`.

Failures: an actor that dies mid-request (its node lost, its process killed) ends that
request as an observation with `error_kind="worker_lost"`; Ray restarts the actor
(`MAX_RESTARTS`), so the tenant's later requests are sent by the new one. Ctrl-C cancels the
remote calls along with the local tasks.

Credentials: the driver resolves a tenant's credential headers for each request and hands
them to the actor as an argument of that call, which the actor uses for that request and
keeps nowhere. Never through Ray's `runtime_env`: Ray writes a runtime env in clear into its
own logs (`session_*/logs/runtime_env_agent.log`, readable by anyone on the node), and the
cluster's nodes need not have the variables at all.

The cluster is connected (`ray_cluster`) before the run writes anything or sends a request:
an address that does not answer as Ray is refused with one line, and nothing is left behind
to stop the same `--out` from being used again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.run.seams import unanswered
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant

if TYPE_CHECKING:
    from kvcanary.harness.target.client import TargetClient
    from kvcanary.harness.target.http_client import Backend

LOCAL = "local"
"""`--ray` without an address: a Ray instance started here for the run (`ray.init()`)."""
MAX_RESTARTS = 3
"""How often Ray brings a dead tenant actor back before its requests fail for good."""
ACTOR_PREFIX = "kvcanary-"
"""Actors are named `kvcanary-<tenant>-<8 hex>` on the cluster, so an operator can find them."""
_TEXT, _DONE = "text", "observation"


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """What an actor needs to build its own target client (`harness.run.wiring`)."""

    base_url: str
    model: str
    deadline_s: float
    read_timeout_s: float
    max_in_flight: int
    backend: Backend = "aiohttp"  # http_client.DEFAULT_BACKEND; imported when the actor starts


class TenantWorker:
    """One tenant's sender on the cluster (a Ray actor): its own HTTP client and clock."""

    def __init__(self, spec: ClientSpec) -> None:
        self._spec = spec
        self._client: TargetClient | None = None

    def pid(self) -> int:
        """The actor's process (tests kill it to lose a worker mid-run)."""
        return os.getpid()

    async def send(
        self, plan: RequestPlan, tenant: Tenant, headers: Mapping[str, str], late_ns: int
    ) -> AsyncIterator[tuple[Any, ...]]:
        """Send `plan` as `tenant` with its credential `headers` (resolved by the driver);
        yield `("text", args)` per delta, then `("observation", obs, t0)` where `t0` is the
        scheduled time on this actor's clock."""
        client = self._target_client()
        # the headers as they are: no variable of this process is read for them
        tenant = dataclasses.replace(tenant, api_key_env=None, headers=dict(headers))
        deltas: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()
        t_scheduled_ns = time.perf_counter_ns() - late_ns

        def on_text(*args: Any) -> None:
            deltas.put_nowait(args)

        sending = asyncio.create_task(
            client.send(plan, tenant, t_scheduled_ns=t_scheduled_ns, on_text=on_text)
        )
        sending.add_done_callback(lambda _: deltas.put_nowait(None))
        try:
            while (args := await deltas.get()) is not None:
                yield (_TEXT, args)
            yield (_DONE, sending.result(), t_scheduled_ns)
        finally:
            sending.cancel()

    def _target_client(self) -> TargetClient:
        # Built on first use, inside the actor's event loop (an aiohttp-backed client binds
        # to the loop it is created on).
        if self._client is None:
            from kvcanary.harness.run import wiring

            spec = self._spec
            http = wiring.http_client(spec.max_in_flight, spec.read_timeout_s, backend=spec.backend)
            self._client = wiring.target_client(http, spec.base_url, spec.model, spec.deadline_s)
        return self._client


class RaySender:
    """The runner's `Sender` over tenant actors: see the module docstring."""

    def __init__(self, actors: Mapping[str, Any]) -> None:
        self.actors = dict(actors)
        """Actor handle by tenant name."""

    async def send(
        self,
        plan: RequestPlan,
        tenant: Tenant,
        *,
        t_scheduled_ns: int,
        on_text: Callable[..., None],
    ) -> Observation:
        import ray.exceptions

        late_ns = max(0, time.perf_counter_ns() - t_scheduled_ns)
        stream = (
            self.actors[plan.tenant]
            .send.options(num_returns="streaming")
            .remote(plan, tenant, tenant.auth_headers(), late_ns)
        )
        try:
            async for ref in stream:
                item = await ref
                if item[0] == _TEXT:
                    on_text(*item[1])
                else:
                    _, obs, t_remote_ns = item
                    return rebased(obs, t_scheduled_ns - t_remote_ns)
        except asyncio.CancelledError:
            ray.cancel(stream)
            raise
        except ray.exceptions.RayActorError as exc:
            return _lost(plan, t_scheduled_ns, f"the Ray actor sending it died: {exc}")
        return _lost(plan, t_scheduled_ns, "the Ray actor ended the stream without an answer")


def rebased(obs: Observation, offset_ns: int) -> Observation:
    """`obs` with every timestamp shifted by `offset_ns` (an actor's clock onto the driver's)."""
    shifted = {
        f.name: value + offset_ns
        for f in dataclasses.fields(obs)
        if f.name.startswith("t_")
        and f.name.endswith("_ns")
        and (value := getattr(obs, f.name)) is not None
    }
    return dataclasses.replace(obs, **shifted)


def _lost(plan: RequestPlan, t_scheduled_ns: int, why: str) -> Observation:
    return unanswered(plan, t_scheduled_ns, time.perf_counter_ns(), "worker_lost", why)


@contextlib.contextmanager
def ray_cluster(address: str) -> Iterator[None]:
    """Connected to the Ray cluster at `address` (`local`: a Ray instance started here for
    the run) for the block; `ConfigError` when it cannot be reached. A Ray already
    initialised in this process is used as it is and left running; one started here is
    shut down at the end."""
    ray = _import_ray()
    check_address(address)
    if ray.is_initialized():
        yield
        return
    try:
        ray.init(
            address=None if address == LOCAL else address,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"--ray {address}: cannot reach the Ray cluster: {exc}") from None
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def ray_sender(tenants: Sequence[Tenant], spec: ClientSpec) -> Iterator[RaySender]:
    """A `RaySender` with one actor per tenant, on the cluster connected (`ray_cluster`)."""
    ray = _import_ray()
    worker = ray.remote(max_restarts=MAX_RESTARTS, max_task_retries=0)(TenantWorker)
    actors = {
        tenant.name: worker.options(
            name=f"{ACTOR_PREFIX}{tenant.name}-{uuid.uuid4().hex[:8]}"
        ).remote(spec)
        for tenant in tenants
    }
    try:
        yield RaySender(actors)
    finally:
        for actor in actors.values():
            ray.kill(actor, no_restart=True)


CONNECT_TIMEOUT_S = 5.0
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""An HTTP/2 client's first bytes (the preface, then an empty SETTINGS frame): a Ray port
(gRPC) answers with a SETTINGS frame, a web server with an HTTP/1 error."""


def check_address(address: str) -> None:
    """Before anything starts: Ray is installed, and something answers at `address` that
    could be Ray. Ray itself retries an address for tens of seconds (an unreachable one for
    minutes); this refuses what is surely not Ray in seconds, in one line."""
    _import_ray()
    where = address.removeprefix("ray://")
    host, sep, port = where.rpartition(":")
    if address in (LOCAL, "auto") or not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S) as sock:
            reply = b"" if os.environ.get("RAY_USE_TLS") else _first_reply(sock)
    except OSError as exc:
        raise ConfigError(
            f"--ray {address}: nothing answers at {host}:{port} ({exc.strerror or exc})"
        ) from None
    if reply.startswith(b"HTTP/"):
        raise ConfigError(
            f"--ray {address}: {host}:{port} answers as a web server (HTTP/1), not as Ray; "
            "give the cluster's GCS address (HOST:6379) or its Ray Client address "
            "(ray://HOST:10001)"
        )


def _first_reply(sock: socket.socket) -> bytes:
    """What `sock` answers an HTTP/2 preface with (empty when it says nothing in time)."""
    try:
        sock.sendall(_H2_PREFACE)
        sock.settimeout(CONNECT_TIMEOUT_S)
        return sock.recv(16)
    except OSError:
        return b""


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--ray needs Ray: pip install 'kvcanary[ray]' (or pip install ray)"
        ) from None
    return ray

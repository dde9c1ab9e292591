"""One tenant's requests on its Ray actor (`--ray`): each plan built, sent, scanned, and its
journal lines written, as the runner would in one process.

    ActorKit     what every actor of a run is made with (its constructor's argument): the
                 planner's settings, the tenants (names, salts, weights: no credential, no
                 header value), the client's settings. Nothing secret: Ray keeps it to
                 restart the actor.
    RunSecrets   what the actors need and must not keep anywhere but in memory: the run's
                 canary key, the tenant's resolved credential headers, every tenant's
                 credential values (scrubbed from what the target sends back), earlier
                 runs' keys (`--keyring`). An argument of every exchange, inline (a few
                 hundred bytes), never in a `runtime_env`, which Ray writes into its logs.
    TenantRun    the actor's run, made from both: the planner (the driver's, rebuilt from
                 the same settings and key, so a plan drawn there builds to the same prompt
                 here), the live index of this tenant's canaries, the content detector,
                 the HTTP client; `send` does one request.

A response is scanned with this index, then, for the runs of canary words it cannot place,
the other actors are asked (`canaries.elsewhere`): whatever canaries they hold live are
added here and the response is scanned again, chunk by chunk, so its hits and findings are
those of one index of every tenant's live canaries. The observation is journaled as the
runner would (`harness.run.settle.journaled_form`), its timestamps moved onto the driver's
clock (`rebased`), and encoded here; the driver writes the lines as they come.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcanary.canaries import CanaryIndex, CanaryMinter, Owner, load_tokenizer
from kvcanary.canaries.alphabet import Alphabet
from kvcanary.canaries.elsewhere import foreign_kgrams
from kvcanary.canaries.prompt import Filler
from kvcanary.harness.detectors.content import ContentDetector, ResponseScan
from kvcanary.harness.record.events import ObservationRecorded, OwnEchoRecorded, PlanRecorded
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.line_encoding import encode_event
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.run.keyring import EarlierRuns, KeyEntry
from kvcanary.harness.run.live_plans import LivePlans
from kvcanary.harness.run.settle import journaled_form
from kvcanary.harness.run.wiring import http_client, owner_of, target_client
from kvcanary.tenants.plan import ApiStyle, Expected, Intent, RequestPlan
from kvcanary.tenants.planner import PlanDraw, Planner, live_canaries
from kvcanary.tenants.size import LimitsLike, ResolvedSize
from kvcanary.tenants.tenant import Tenant
from kvcanary.tenants.workload import WorkloadProfile

if TYPE_CHECKING:
    from kvcanary.harness.target.client import TargetClient
    from kvcanary.harness.target.http_client import Backend

Sent = tuple[str, bytes, Observation, bytes, tuple[Finding, ...], tuple[Finding, ...], Any]
"""What an actor reports of one request: its id, the plan's journal line, the observation
as journaled but without its text, the observation's line, the content findings made while
it streamed and at its end, its own-echo event (or None)."""
Sketch = tuple[str, str, Intent, str, int, Expected]
"""A plan drawn, as it travels to its actor (a tuple pickles several times faster than the
dataclass): request id, phase, intent, size label, prompt tokens, expected outcome."""
_REQUEST_ID = re.compile(r"t(\d+)-r(\d+)")  # `tenants.planner.request_id`, read back


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """What an actor needs to build its own target client (`harness.run.wiring`)."""

    base_url: str
    model: str
    deadline_s: float
    read_timeout_s: float
    max_in_flight: int
    backend: Backend = "aiohttp"  # http_client.DEFAULT_BACKEND; imported when the actor starts


@dataclass(frozen=True, slots=True)
class ActorKit:
    """Everything an actor is made with; nothing secret (see the module docstring)."""

    tenants: tuple[Tenant, ...]
    """The run's tenants, in order, without credentials or header values."""
    client: ClientSpec
    profile: WorkloadProfile
    limits: LimitsLike
    api: ApiStyle
    page_size: int
    seed: int
    chat_overhead_tokens: int
    filler: Filler
    alphabet: Alphabet
    num_words: int
    tokenizer: str | None
    """The tokenizer's name or path (`load_tokenizer`), or None: plans come built."""
    keep_raw_evidence: bool = False
    earlier: tuple[KeyEntry, ...] = ()
    """Earlier runs' keyring entries (`--keyring`), their keys blanked: `RunSecrets` has them."""

    @classmethod
    def of(cls, planner: Planner, client: ClientSpec, **options: Any) -> ActorKit:
        """The kit of the driver's `planner`; `tokenizer=None` where it cannot travel."""
        bare = tuple(dataclasses.replace(t, api_key_env=None, headers={}) for t in planner.tenants)
        options.setdefault("tokenizer", planner.tokenizer.name)
        return cls(
            bare, client, planner.profile, planner.limits, planner.api, planner.page_size,
            planner.seed, planner.chat_overhead_tokens, planner.filler,
            planner.minter.alphabet, planner.minter.num_words, **options,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class RunSecrets:
    """What an exchange hands its actor to use and keep in memory only."""

    key: bytes = field(repr=False)
    headers: dict[str, str] = field(repr=False)
    secrets: tuple[str, ...] = field(repr=False)
    earlier_keys: tuple[bytes, ...] = field(default=(), repr=False)


class TenantRun:
    """One actor's side of a run: see the module docstring."""

    def __init__(self, kit: ActorKit, secrets: RunSecrets) -> None:
        self.key = secrets.key
        self._kit = kit
        minter = CanaryMinter(secrets.key, num_words=kit.num_words, alphabet=kit.alphabet)
        self.planner: Planner | None = None
        if kit.tokenizer is not None:
            self.planner = Planner(
                kit.tenants, kit.profile, load_tokenizer(kit.tokenizer), minter, kit.limits,
                api=kit.api, page_size=kit.page_size, seed=kit.seed,
                chat_overhead_tokens=kit.chat_overhead_tokens, filler=kit.filler,
            )  # fmt: skip
        keep_live = live_canaries(kit.limits, kit.page_size)
        self.index = CanaryIndex(minter, owner_of=owner_of(kit.tenants), keep_live=keep_live)
        self._live = LivePlans(self.index)
        earlier = [
            dataclasses.replace(entry, key=key)
            for entry, key in zip(kit.earlier, secrets.earlier_keys, strict=True)
        ]
        self._content = ContentDetector(
            self.index,
            redact_excerpts=not kit.keep_raw_evidence,
            earlier_runs=EarlierRuns(earlier) if earlier else None,
        )
        self._tenants = {tenant.name: tenant for tenant in kit.tenants}
        self._client: TargetClient | None = None
        self.peers: Sequence[Any] = ()
        """The other actors of the run (their `lookup`)."""

    def built(self, plans: Sequence[Sketch | RequestPlan]) -> list[RequestPlan]:
        """`plans` with their prompts: sketches built here (one batch), plans as given."""
        sketches = [plan for plan in plans if isinstance(plan, tuple)]
        if not sketches:
            return [plan for plan in plans if isinstance(plan, RequestPlan)]
        assert self.planner is not None, "sketches for an actor without a tokenizer"
        planner = self.planner
        made = iter(planner.build([draw_of(planner, sketch) for sketch in sketches]))
        return [next(made) if isinstance(plan, tuple) else plan for plan in plans]

    async def send(
        self, plan: RequestPlan, t_scheduled_ns: int, offset_ns: int, secrets: RunSecrets
    ) -> Sent:
        """Send `plan` (scheduled at `t_scheduled_ns` on this actor's clock; `offset_ns` moves
        that clock onto the driver's) and scan, redact and encode what came back."""
        self._live.register(plan)
        tenant = dataclasses.replace(self._tenants[plan.tenant], headers=dict(secrets.headers))
        chunks: list[tuple[str, str]] = []
        scan = self._content.start(plan)
        streamed: list[Finding] = []

        def on_text(chunk: str, field: str = "content") -> None:
            chunks.append((chunk, field))
            streamed.extend(scan.feed(chunk, field))

        client = self._target_client()
        obs = await client.send(plan, tenant, t_scheduled_ns=t_scheduled_ns, on_text=on_text)
        content = scan.finish(obs)
        kgrams = foreign_kgrams(self.index, "".join(c for c, _ in chunks), scan.hits)
        if kgrams and self.peers and await self._learn(kgrams):
            scan, streamed, content = self._rescan(plan, chunks, obs)
        journaled, _ = journaled_form(
            obs, scan.hits, secrets.secrets, keep_raw_evidence=self._kit.keep_raw_evidence
        )
        journaled = rebased(journaled, offset_ns)
        echo: OwnEchoRecorded | None = scan.own_echo_event(time.time())
        return (
            plan.request_id,
            encode_event(PlanRecorded(plan)),
            dataclasses.replace(journaled, text=""),
            encode_event(ObservationRecorded(journaled)),
            tuple(streamed),
            tuple(content),
            echo,
        )

    async def _learn(self, kgrams: set[str]) -> bool:
        """Ask the other actors whose live canaries hold `kgrams`; keep what they name."""
        asked = sorted(kgrams)
        replies = await asyncio.gather(
            *(peer.lookup.remote(asked) for peer in self.peers), return_exceptions=True
        )  # a peer lost meanwhile: its canaries are not live anywhere now
        index = self.index
        found: dict[str, Owner] = {
            canary: owner
            for reply in replies
            if isinstance(reply, list)
            for canary, owner in reply
            if canary not in index
        }
        if found:
            self._live.keep_foreign(list(found.items()))
        return bool(found)

    def _rescan(
        self, plan: RequestPlan, chunks: list[tuple[str, str]], obs: Observation
    ) -> tuple[ResponseScan, list[Finding], list[Finding]]:
        """The response scanned again, chunk by chunk, with what the index holds now."""
        scan = self._content.start(plan)
        streamed = [finding for chunk, field in chunks for finding in scan.feed(chunk, field)]
        return scan, streamed, scan.finish(obs)

    def _target_client(self) -> TargetClient:
        # Built on first use, inside the actor's event loop (an aiohttp-backed client binds
        # to the loop it is created on).
        if self._client is None:
            spec = self._kit.client
            http = http_client(spec.max_in_flight, spec.read_timeout_s, backend=spec.backend)
            self._client = target_client(http, spec.base_url, spec.model, spec.deadline_s)
        return self._client


def sketch_of(plan: RequestPlan) -> Sketch:
    """What `draw_of` needs of a plan drawn (`Planner.sketch`)."""
    return (
        plan.request_id, plan.phase, plan.intent, plan.size_label, plan.num_prompt_tokens,
        plan.expected,
    )  # fmt: skip


def draw_of(planner: Planner, sketch: Sketch) -> PlanDraw:
    """The draw a sketch was made from: `planner` builds it into its plan."""
    request_id, phase, intent, size_label, num_tokens, expected = sketch
    match = _REQUEST_ID.fullmatch(request_id)
    assert match is not None, request_id
    size = ResolvedSize(size_label, size_label, intent, num_tokens, expected)
    tenant_index, request = int(match.group(1)), int(match.group(2))
    return PlanDraw(phase, intent, size, tenant_index, request, planner)


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

"""Which preset and profile let `kvcanary run`'s abort phase reach the abort race (#35049).

A default run's plans, in the order its runner sends them one at a time (the bundled engine's
concurrency), replayed through decode's own scheduler and allocator (no torch, no clock).
Under SGLang's sorted PD free order an aborted request's pages wait in the release list, so
the request right after an abort is handed them only when its allocation finds the free list
short and merges. The late write then has to land after that request's own write: its write
must be the shorter one (one write per prompt, flight time proportional to size).

`race` preset + `race` profile: every abort's follower gets the aborted request's pages with a
write a seventh as long. `vulnerable` + `incident` (the defaults): no follower ever does,
which is why the default run's abort phase cannot show the race (README, "The abort race
over HTTP").
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_helpers import run_limits

from kvcanary.harness.run.phases import Workload, default_phases
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.decode_scheduler import DecodeScheduler
from kvcanary.reference_engine.finish import client_aborted
from kvcanary.reference_engine.interfaces import GenerateRequest, KVPoll, TransferStatus
from kvcanary.reference_engine.sequence import Req
from kvcanary.tenants.planner import sketch_streams
from kvcanary.tenants.workload import PROFILES, WorkloadProfile

NUM_REQUESTS = 60
"""`kvcanary run`'s default budget."""


@dataclass(frozen=True, slots=True)
class Follower:
    """The request decode admitted right after an abort plan."""

    num_aborted_tokens: int
    num_tokens: int
    num_shared_pages: int
    """How many of the aborted request's pages it was handed."""
    max_tokens: int
    """How long it decodes over them: the late write must land while it still reads."""


def decode_one(scheduler: DecodeScheduler, req: Req) -> None:
    """Commit `req` and decode it to its length (pages for new tokens come as it grows)."""
    req.transfer_status = TransferStatus(req.room, KVPoll.SUCCESS, first_token_id=11)
    scheduler.pop_transferred()
    scheduler.commit(req, lambda pages: 0)
    while req in scheduler.running:
        batch, ended = scheduler.schedule_decode()
        assert not ended
        scheduler.on_decoded(batch, [11] * len(batch))


def followers(preset: str, profile: WorkloadProfile) -> list[Follower]:
    config = EngineConfig.from_preset(preset)
    assert config.free_order == "sorted"
    workload = Workload(
        sketch_streams(profile, run_limits(config), "completions"),
        default_phases(profile.victim_fraction),
    )
    scheduler = DecodeScheduler(config)
    aborted: tuple[int, list[int]] | None = None
    """The last abort plan's prompt length and the pages it held."""
    found: list[Follower] = []
    for i in range(NUM_REQUESTS):
        plan = workload.next_plan(workload.phase_at(i / NUM_REQUESTS))
        assert plan is not None
        ids = tuple(range(1, plan.num_prompt_tokens + 1))
        req = Req.from_request(GenerateRequest(f"r{i}", ids, plan.max_tokens, i))
        scheduler.add(req)
        if req.is_finished:  # refused at intake: no pages
            continue
        assert scheduler.pop_preallocated() == [req]
        if aborted is not None:
            num_aborted_tokens, aborted_pages = aborted
            shared = set(req.page_ids) & set(aborted_pages)
            found.append(
                Follower(num_aborted_tokens, req.num_prompt_tokens, len(shared), plan.max_tokens)
            )
            aborted = None
        if plan.intent == "abort":  # the client left at the head: decode aborts it
            aborted = (req.num_prompt_tokens, list(req.page_ids))
            scheduler.abort(req.rid, client_aborted(req.rid))
            scheduler.release(req)  # the vulnerable decode frees at once
        else:
            decode_one(scheduler, req)
    return found


def test_under_the_race_preset_every_follower_gets_the_aborted_pages_with_a_shorter_write() -> None:
    found = followers("race", PROFILES["race"])
    assert len(found) >= 4  # a 60-request run's abort phase
    for follower in found:
        assert follower.num_shared_pages > 0
        assert follower.num_tokens * 4 < follower.num_aborted_tokens
        assert follower.max_tokens == PROFILES["race"].victim_max_tokens  # a victim, not a probe


def test_the_default_run_never_hands_an_aborted_request_s_pages_to_the_next() -> None:
    found = followers("vulnerable", PROFILES["incident"])
    assert found  # the abort phase did abort
    assert all(follower.num_shared_pages == 0 for follower in found)

"""DecodeScheduler: reservation from decode's own view, commit checks, growth (no torch)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.decode_scheduler import DecodeScheduler
from kvcanary.reference_engine.finish import client_aborted
from kvcanary.reference_engine.interfaces import GenerateRequest, KVPoll, TransferStatus
from kvcanary.reference_engine.sequence import Req


def config(*fixes: str, **overrides: object) -> EngineConfig:
    return EngineConfig.from_preset(
        "vulnerable", context_length=1024, fixes=frozenset(fixes), **overrides
    )


def request(rid: str, num_tokens: int, max_new: int = 32, room: int = 7) -> Req:
    return Req.from_request(GenerateRequest(rid, tuple(range(1, num_tokens + 1)), max_new, room))


def no_checksum(pages: Sequence[int]) -> int:
    raise AssertionError("checksum computed without the kv_checksum fix")


def preallocated(scheduler: DecodeScheduler, req: Req) -> None:
    scheduler.add(req)
    assert scheduler.pop_preallocated() == [req]


def success(req: Req, **fields: object) -> TransferStatus:
    return TransferStatus(req.room, KVPoll.SUCCESS, first_token_id=11, **fields)  # type: ignore[arg-type]


def test_decode_reserves_pages_for_its_own_view_of_the_prompt() -> None:
    scheduler = DecodeScheduler(config())
    req = request("big", 900, max_new=64)  # over prefill's limit, under decode's (1018)
    preallocated(scheduler, req)
    assert req.to_finish is None
    assert len(req.page_ids) == 57  # ceil(900 / 16)
    assert req.num_reserved_pages == 61 - 57  # room for the tokens to come
    assert req.poll == KVPoll.WAITING_FOR_INPUT


def test_vulnerable_commit_checks_only_the_room() -> None:
    scheduler = DecodeScheduler(config())
    req = request("big", 900)
    preallocated(scheduler, req)
    req.transfer_status = success(req)  # prefill wrote one page, says nothing more
    assert scheduler.pop_transferred() == [req]
    scheduler.commit(req, no_checksum)
    assert not req.is_finished
    assert scheduler.running == [req]
    assert req.output_ids == [11]


def test_room_mismatch_and_failure_abort_with_500() -> None:
    for status in (
        TransferStatus(999, KVPoll.SUCCESS, first_token_id=1),
        TransferStatus(7, KVPoll.FAILED),
    ):
        scheduler = DecodeScheduler(config())
        req = request("r", 100)
        preallocated(scheduler, req)
        req.transfer_status = status
        scheduler.commit(req, no_checksum)
        assert req.finished is not None
        assert req.finished.status == 500
        assert scheduler.allocator.num_allocated_pages == 0


def test_coverage_check_compares_written_tokens_with_the_reservation() -> None:
    scheduler = DecodeScheduler(config("coverage_check"))
    short, full = request("short", 900), request("full", 900, room=8)
    preallocated(scheduler, short)
    preallocated(scheduler, full)
    short.transfer_status = success(short, num_tokens_written=1)
    full.transfer_status = success(full, num_tokens_written=900)
    scheduler.commit(short, no_checksum)
    scheduler.commit(full, no_checksum)
    assert short.finished is not None
    assert short.finished.error is not None
    assert "coverage" in short.finished.error["message"]
    assert full.finished is None


def test_kv_checksum_compares_and_skips_a_missing_one() -> None:
    scheduler = DecodeScheduler(config("kv_checksum"))
    reqs = [request(f"r{i}", 100, room=i) for i in range(3)]
    for req in reqs:
        preallocated(scheduler, req)
    reqs[0].transfer_status = success(reqs[0], checksum=123)
    reqs[1].transfer_status = success(reqs[1], checksum=124)
    reqs[2].transfer_status = success(reqs[2])  # prefill published none: skipped (#39500)
    for req in reqs:
        scheduler.commit(req, lambda pages: 123)
    assert [r.finished is None for r in reqs] == [True, False, True]


def test_page_tags_catch_pages_nobody_wrote_since_reallocation() -> None:
    scheduler = DecodeScheduler(config("page_tags"))
    written, stale = request("w", 100), request("s", 100, room=8)
    preallocated(scheduler, written)
    preallocated(scheduler, stale)
    scheduler.tags.stamp(written.page_ids, written.page_generations)  # the sink wrote them
    scheduler.tags.stamp(stale.page_ids[:1], stale.page_generations[:1])  # one page only
    written.transfer_status, stale.transfer_status = success(written), success(stale)
    scheduler.commit(written, no_checksum)
    scheduler.commit(stale, no_checksum)
    assert written.finished is None
    assert stale.finished is not None
    assert stale.finished.error is not None
    assert "owned by another writer" in stale.finished.error["message"]


def test_decode_side_deferred_rejection_surfaces_at_commit() -> None:
    small_decode = config(decode_pool_tokens=512)  # decode limit 506
    scheduler = DecodeScheduler(small_decode)
    req = request("big", 600)
    scheduler.add(req)
    assert req.origin_input_ids == [0]
    assert scheduler.pop_preallocated() == [req]
    assert len(req.page_ids) == 1
    req.transfer_status = success(req)
    scheduler.commit(req, no_checksum)
    assert req.finished is not None
    assert req.finished.status == 400


def test_running_requests_grow_into_their_reservation_and_finish() -> None:
    scheduler = DecodeScheduler(config())
    req = request("r", 16, max_new=20)
    preallocated(scheduler, req)
    req.transfer_status = success(req)
    scheduler.commit(req, no_checksum)
    steps = 0
    while scheduler.running:
        batch, ended = scheduler.schedule_decode()
        assert ended == []
        scheduler.on_decoded(batch, [3] * len(batch))
        steps += 1
    assert steps == 19
    assert req.finished is not None
    assert (req.finished.status, req.finished.completion_tokens) == (200, 20)
    assert scheduler.allocator.num_allocated_pages == 0
    assert scheduler.num_reserved_pages == 0


def test_budget_holds_requests_in_the_prealloc_queue() -> None:
    scheduler = DecodeScheduler(config(decode_pool_tokens=1024))  # 64 pages
    first, second = request("a", 600, max_new=100), request("b", 600, max_new=100, room=8)
    scheduler.add(first)
    scheduler.add(second)
    assert scheduler.pop_preallocated() == [first]  # 44 pages reserved; 44 more do not fit
    scheduler.abort("a", client_aborted("a"))
    scheduler.release(first)
    assert scheduler.pop_preallocated() == [second]


@pytest.mark.parametrize("where", ["prealloc", "transfer", "running"])
def test_abort_finishes_and_release_returns_everything(where: str) -> None:
    scheduler = DecodeScheduler(config())
    req = request("r", 100)
    scheduler.add(req)
    if where != "prealloc":
        scheduler.pop_preallocated()
    if where == "running":
        req.transfer_status = success(req)
        scheduler.commit(req, no_checksum)
    aborted = scheduler.abort("r", client_aborted("r"))
    assert aborted is req
    assert req.finished is not None
    assert req.finished.status == 499
    scheduler.release(req)
    assert scheduler.allocator.num_allocated_pages == 0
    assert scheduler.num_reserved_pages == 0
    assert scheduler.find("r") is None

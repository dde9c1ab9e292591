"""PrefillScheduler: the incident's intake path, chunking and the sender's page count (no torch)."""

from __future__ import annotations

from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.interfaces import GenerateRequest, KVPoll, TransferMetadata
from kvcanary.reference_engine.prefill_scheduler import PrefillScheduler
from kvcanary.reference_engine.sequence import PLACEHOLDER_INPUT_IDS, Req

CONFIG = EngineConfig.from_preset("vulnerable", context_length=1024)  # prefill limit 650


def request(rid: str, num_tokens: int, room: int = 7) -> Req:
    return Req.from_request(GenerateRequest(rid, tuple(range(1, num_tokens + 1)), 32, room))


def bootstrapped(scheduler: PrefillScheduler, req: Req, num_dst_pages: int) -> None:
    scheduler.add(req)
    meta = TransferMetadata(req.room, tuple(range(100, 100 + num_dst_pages)), 0)
    scheduler.on_bootstrapped(req, meta)


def test_vulnerable_intake_swaps_in_the_placeholder_and_admits_it() -> None:
    scheduler = PrefillScheduler(CONFIG)
    req = request("big", 900)
    scheduler.add(req)
    assert not req.is_finished
    assert req.origin_input_ids == PLACEHOLDER_INPUT_IDS
    assert req.to_finish is not None
    assert req.to_finish.status == 400
    assert req.to_finish.message.startswith("Input length (900 tokens) exceeds the maximum")
    assert "(650 tokens)" in req.to_finish.message
    assert scheduler.bootstrap_queue == {"big": req}
    assert req.max_new_tokens == 1


def test_admission_retire_finishes_with_the_400_before_bootstrap() -> None:
    scheduler = PrefillScheduler(
        EngineConfig.from_preset(
            "vulnerable", context_length=1024, fixes=frozenset({"admission_retire"})
        )
    )
    req = request("big", 900)
    scheduler.add(req)
    assert req.finished is not None
    assert req.finished.status == 400
    assert req.finished.error is not None
    assert req.finished.error["type"] == "BadRequestError"
    assert not scheduler.bootstrap_queue


def test_the_sender_copies_min_of_source_and_destination_pages() -> None:
    scheduler = PrefillScheduler(CONFIG)
    placeholder = request("big", 900)
    bootstrapped(scheduler, placeholder, num_dst_pages=57)  # decode reserved the full prompt
    assert scheduler.num_pages_to_send(placeholder) == 1
    short_dst = request("short", 320, room=8)
    bootstrapped(scheduler, short_dst, num_dst_pages=3)
    assert scheduler.num_pages_to_send(short_dst) == 3


def test_chunked_prefill_allocates_at_the_first_chunk_and_readies_whole_pages() -> None:
    config = EngineConfig.from_preset("vulnerable", context_length=1024, prefill_chunk_tokens=40)
    scheduler = PrefillScheduler(config)
    req = request("r", 100)
    bootstrapped(scheduler, req, num_dst_pages=7)
    assert req.poll == KVPoll.WAITING_FOR_INPUT
    scheduled = scheduler.schedule()
    assert scheduled == (req, 0, 40)
    assert len(req.page_ids) == 7
    scheduler.on_chunk_done(req, 40, None)
    assert req.num_ready_pages == 2  # 40 tokens = 2 whole pages of 16
    assert scheduler.schedule() == (req, 40, 80)
    scheduler.on_chunk_done(req, 80, None)
    assert scheduler.schedule() == (req, 80, 100)
    scheduler.on_chunk_done(req, 100, token=42)
    assert req.num_ready_pages == 7
    assert req.output_ids == [42]
    assert scheduler.prefill_done(req)
    assert scheduler.schedule() is None


def test_success_reports_the_placeholder_length_and_200_despite_the_deferred_400() -> None:
    scheduler = PrefillScheduler(CONFIG)
    req = request("big", 900)
    bootstrapped(scheduler, req, num_dst_pages=57)
    req_, start, end = scheduler.schedule() or (None, 0, 0)
    assert (req_, start, end) == (req, 0, 1)
    scheduler.on_chunk_done(req, 1, token=5)
    scheduler.finish_success(req)
    assert req.finished is not None
    assert (req.finished.status, req.finished.prompt_tokens) == (200, 1)
    assert scheduler.allocator.num_allocated_pages == 0


def test_waiting_head_waits_for_pages() -> None:
    config = EngineConfig.from_preset("vulnerable", context_length=1024)  # 41 prefill pages
    scheduler = PrefillScheduler(config)
    first, second = request("a", 640), request("b", 640, room=8)
    bootstrapped(scheduler, first, 40)
    bootstrapped(scheduler, second, 40)
    assert scheduler.schedule() is not None
    scheduler.on_chunk_done(first, 512, None)
    scheduler.on_chunk_done(first, 640, token=1)
    assert scheduler.schedule() is None  # 40 + 40 pages > 41
    scheduler.finish_success(first)
    assert scheduler.schedule() == (second, 0, 512)


def test_release_zeroes_pages_only_with_zero_on_free() -> None:
    zeroed: list[list[int]] = []
    for fixes, expect_zeroed in ((frozenset(), False), (frozenset({"zero_on_free"}), True)):
        config = EngineConfig.from_preset("vulnerable", context_length=1024, fixes=fixes)
        scheduler = PrefillScheduler(config, zero_pages=lambda pages: zeroed.append(list(pages)))
        req = request("r", 40)
        bootstrapped(scheduler, req, 3)
        scheduler.schedule()
        pages = list(req.page_ids)
        scheduler.release(req)
        assert (zeroed[-1:] == [pages]) is expect_zeroed

"""Fault injection: every kind of hostile answer, for a completion and for discovery, ends in
an observation (or an attempt) with a clear error kind, or a clean one; never an exception,
and in bounded memory where the answer is huge or inflates.

One parametrised test per side, over real TCP (`fault_server` under uvicorn). Memory is the
Python heap's peak while the fault is served (`tracemalloc`; server and client share the
process, so the bound covers both): a client that buffered a 200 MB body or a gzip bomb
would pass it by orders of magnitude.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
import tracemalloc
from collections.abc import Iterator

import fault_server
import httpx
import misbehaving_server
import pytest
from raw_listener import raw_listener
from word_tokenizer import WordTokenizer

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.events import ObservationRecorded, from_record
from kvcanary.harness.record.journal import encode_event
from kvcanary.harness.record.observation import ErrorKind
from kvcanary.harness.target.calibration import measure_prompt_token_offset
from kvcanary.harness.target.client import TargetClient, make_http_client
from kvcanary.harness.target.http_client import Backend
from kvcanary.harness.target.server_info import read_engine_facts
from kvcanary.tenants.plan import RequestPlan
from kvcanary.tenants.tenant import Tenant

CAP = 1024 * 1024
HEAP_BOUND = 48 * 1024 * 1024
"""Far above what a response cut at `CAP` costs, far below any unbounded read of a fault."""
TIMEOUT = httpx.Timeout(5.0, read=1.0)
DEADLINE_S = 2.0
DISCOVERY_TIMEOUT_S = 1.0
"""Short bounds, for the faults that never answer (the timeout kinds, the hangs)."""
ANSWER_TIMEOUT = httpx.Timeout(60.0)
ANSWER_DEADLINE_S = 60.0
"""For every other fault: a loaded machine must never turn its answer into a timeout."""

# fault -> the error kind its observation must carry (None: a clean observation), bounded heap
COMPLETION_FAULTS: list[tuple[str, ErrorKind | None, bool]] = [
    ("malformed", "protocol", False),  # bad JSON in an event
    ("truncated", "truncated", False),
    ("missing_done", "truncated", False),
    ("reset", "truncated", False),
    ("status_500", "http_status", False),
    ("status_400", "http_status", False),
    ("status_429", "http_status", False),
    ("status_429_retry_after", "http_status", False),
    ("status_503_retry_after", "http_status", False),
    ("status_500_gzip", "http_status", False),
    ("html_500", "http_status", False),
    ("not_sse", "protocol", False),  # an HTML page after 200
    ("redirect", "http_status", False),
    ("error_after_200", "error_in_success", False),
    ("error_event", "error_in_success", False),
    ("hang", "timeout", False),  # before the headers
    ("hang_mid_stream", "timeout", False),
    ("trickle_1bps", "timeout", False),
    ("keepalive", None, False),  # CRLF line ends, comments
    ("cr_lines", None, False),  # bare CR line ends
    ("surrogate", None, False),
    ("usage_huge", "protocol", False),
    ("usage_negative", "protocol", False),
    ("usage_float", "protocol", False),
    ("usage_string", "protocol", False),
    ("usage_list", "protocol", False),
    ("deep_json", "protocol", False),
    ("gzip_ok", None, False),
    ("huge", "too_large", True),
    ("huge_line", "too_large", True),
    ("body_200mb", "too_large", True),
    ("gzip_bomb", "too_large", True),
    ("deflate_bomb", "too_large", True),
]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with misbehaving_server.serve(fault_server.app) as root:
        yield root


def plan() -> RequestPlan:
    return RequestPlan(
        request_id="t0-r000001",
        tenant="tenant-0",
        phase="probe",
        intent="probe",
        size_label="small",
        num_prompt_tokens=3,
        expected="accept",
        api="chat",
        prompt="three word prompt",
        max_tokens=4,
    )


class HeapPeak:
    """The Python heap's peak above its starting point, while in the `with` block."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.peak = 0

    def __enter__(self) -> HeapPeak:
        if self.enabled:
            tracemalloc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            self.peak = peak


@pytest.mark.parametrize(("fault", "kind", "bounded"), COMPLETION_FAULTS)
async def test_every_completion_fault_ends_in_a_journaled_observation(
    url: str, fault: str, kind: ErrorKind | None, bounded: bool, backend: Backend
) -> None:
    hangs = kind == "timeout"
    with HeapPeak(bounded) as heap:
        timeout = TIMEOUT if hangs else ANSWER_TIMEOUT
        async with make_http_client(timeout=timeout, backend=backend) as http:
            client = TargetClient(
                http,
                f"{url}/{fault}",
                model="m",
                max_response_bytes=CAP,
                deadline_s=DEADLINE_S if hangs else ANSWER_DEADLINE_S,
            )
            observation = await client.send(
                plan(), Tenant(name="tenant-0"), t_scheduled_ns=time.perf_counter_ns()
            )
    assert observation.error_kind == kind, observation.error
    assert (observation.error is None) == (kind is None)
    assert observation.num_text_chars <= CAP
    if bounded:
        assert heap.peak < HEAP_BOUND, f"{fault}: heap peak {heap.peak / 2**20:.1f} MiB"
    if fault == "surrogate":
        assert observation.text == "a\ufffdbc"
    if fault == "gzip_ok":
        assert observation.text == "word0 word1 word2 "
    if fault == "status_500_gzip":
        assert "on purpose: compressed" in (observation.error or "")
    if fault.startswith("usage_") or fault == "deep_json":
        assert observation.text == "word0 "  # what came before the bad part is kept
    # the observation is journaled as it is, and reads back the same
    line = encode_event(ObservationRecorded(observation))
    assert from_record(json.loads(line)) == ObservationRecorded(observation)


# fault -> what the attempt at the faulty path must say, bounded heap
DISCOVERY_FAULTS: list[tuple[str, str, str, bool]] = [
    ("models_hang", "/v1/models", "Timeout|within", False),
    ("all_hang", "/get_server_info", "Timeout|within", False),
    ("models_huge", "/v1/models", "larger than", True),
    ("models_gzip_bomb", "/v1/models", "larger than", True),
    ("models_deep", "/v1/models", "nested deeper", False),
    ("metrics_huge", "/metrics", "larger than", True),
]


@pytest.mark.parametrize(("fault", "path", "error", "bounded"), DISCOVERY_FAULTS)
async def test_every_discovery_fault_is_a_recorded_attempt(
    url: str, fault: str, path: str, error: str, bounded: bool, backend: Backend
) -> None:
    with HeapPeak(bounded) as heap:
        async with make_http_client(timeout=httpx.Timeout(300.0), backend=backend) as http:
            hangs = fault.endswith("_hang")
            timeout_s = DISCOVERY_TIMEOUT_S if hangs else ANSWER_DEADLINE_S
            facts = await read_engine_facts(http, f"{url}/{fault}", timeout_s=timeout_s)
    attempt = next(a for a in facts.attempts if a.url.endswith(path))
    assert attempt.error is not None
    assert any(word in attempt.error for word in error.split("|")), attempt.describe()
    assert attempt.yielded == "nothing"
    assert facts.model is None
    if bounded:
        assert heap.peak < HEAP_BOUND, f"{fault}: heap peak {heap.peak / 2**20:.1f} MiB"
    if fault == "all_hang":
        # nothing answered within the timeout: the rest is not asked (one timeout, not three)
        assert [a.yielded for a in facts.attempts if a.url.endswith("/metrics")] == ["not tried"]


async def test_a_lone_surrogate_in_a_model_name_is_replaced(url: str, backend: Backend) -> None:
    async with make_http_client(backend=backend) as http:
        facts = await read_engine_facts(
            http, f"{url}/models_surrogate", timeout_s=ANSWER_DEADLINE_S
        )
    assert facts.model == "m\ufffd"
    assert facts.context_tokens == 4096


async def test_cancelling_discovery_stops_it_at_once(url: str, backend: Backend) -> None:
    """Ctrl-C arrives as a cancellation: it must end discovery, not be taken for a timeout."""
    async with make_http_client(backend=backend) as http:
        task = asyncio.ensure_future(read_engine_facts(http, f"{url}/all_hang", timeout_s=60.0))
        waits = 0
        while not task.done() and waits < 20:  # let both requests get under way
            await asyncio.sleep(0.05)
            waits += 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=30.0)


@pytest.fixture
def resetting_url() -> Iterator[str]:
    """A listener that resets every connection as soon as it is accepted (no HTTP at all)."""

    def reset(conn: socket.socket) -> None:
        conn.recv(65536)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # linger 0: a reset, not a clean close

    with raw_listener(reset) as port:
        yield f"http://127.0.0.1:{port}"


async def test_a_reset_before_the_response_head_is_an_observation(
    resetting_url: str, backend: Backend
) -> None:
    async with make_http_client(timeout=TIMEOUT, backend=backend) as http:
        client = TargetClient(http, resetting_url, model="m", deadline_s=DEADLINE_S)
        observation = await client.send(
            plan(), Tenant(name="tenant-0"), t_scheduled_ns=time.perf_counter_ns()
        )
        facts = await read_engine_facts(http, resetting_url, timeout_s=DISCOVERY_TIMEOUT_S)
    assert observation.status is None
    assert observation.error_kind in ("connect", "protocol"), observation.error
    assert not facts.reachable
    assert all(a.error for a in facts.attempts)


@pytest.mark.parametrize("fault", ["gzip_bomb", "body_200mb", "deep_json"])
async def test_one_off_requests_read_hostile_answers_bounded(
    url: str, fault: str, backend: Backend
) -> None:
    """Calibration reads one non-streamed answer: a bomb or a huge body is cut at 1 MiB and
    becomes the usual one-line `ConfigError` (the run then goes on without the offset)."""
    with HeapPeak(True) as heap:
        async with make_http_client(timeout=ANSWER_TIMEOUT, backend=backend) as http:
            with pytest.raises(ConfigError, match="calibration request") as raised:
                await measure_prompt_token_offset(
                    http, f"{url}/{fault}", "m", "completions", WordTokenizer(), Tenant("t")
                )
    assert "\n" not in str(raised.value)
    assert heap.peak < HEAP_BOUND, f"{fault}: heap peak {heap.peak / 2**20:.1f} MiB"

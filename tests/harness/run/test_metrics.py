"""A soak that tells how it is doing: Prometheus metrics that agree with the journal, and a
heartbeat line in logs when nothing else is printed.

The 20-minute soak is marked `soak`, which the default run deselects (`-m "not soak"` in
pyproject's addopts); run it with `pytest -m soak`.
"""

from __future__ import annotations

import contextlib
import io
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from misbehaving_server import serve
from prometheus_client.parser import text_string_to_metric_families
from test_cli_run import LIMIT_FLAGS, Receive, Scope, Send, _start, fake_target, of_type, records

from kvcanary.harness.record.events import (
    FindingRecorded,
    ObservationRecorded,
    PlanRecorded,
    TargetServing,
    TargetUnhealthy,
)
from kvcanary.harness.record.finding import Finding, FindingKind
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.run.metrics import RunMetrics
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.tenants.plan import RequestPlan


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample of a scrape: name -> labels -> value."""
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            found.setdefault(sample.name, {})[labels] = sample.value
    return found


def by_label(scrape: dict[str, Any], name: str, label: str) -> Counter[str]:
    return Counter({dict(k)[label]: int(v) for k, v in scrape.get(name, {}).items()})


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return samples(response.read().decode())


def plan(request_id: str, intent: Any = "victim") -> RequestPlan:
    return RequestPlan(request_id, "tenant-0", "fill", intent, "x", 10, "accept", "completions", "")


def test_the_metrics_count_requests_errors_findings_ttft_and_health() -> None:
    metrics = RunMetrics()
    metrics.handle(PlanRecorded(plan("a", "victim")))
    metrics.handle(PlanRecorded(plan("b", "probe")))
    ok = Observation("a", "tenant-0", 200, 0.0, 0, 1_000, t_first_token_ns=251_000_000)
    rejected = Observation("b", "tenant-0", 400, 0.0, 0, 0, error_kind="http_status")
    metrics.handle(ObservationRecorded(ok))
    metrics.handle(ObservationRecorded(rejected))
    finding = Finding(
        kind=FindingKind.CROSS_TENANT_CANARY,
        severity=FindingKind.CROSS_TENANT_CANARY.severity,
        detector="content",
        request_id="a",
        tenant="tenant-0",
        summary="x",
    )
    metrics.handle(FindingRecorded(finding, t_wall=0.0))
    unhealthy = TargetUnhealthy(
        t_wall=0.0,
        since_t_wall=0.0,
        num_failed=3,
        num_served_before=1,
        first_request_id="b",
        last_error="503",
    )
    metrics.handle(unhealthy)
    from prometheus_client import generate_latest

    got = samples(generate_latest(metrics.registry).decode())
    assert by_label(got, "kvcanary_requests_total", "intent") == {"victim": 1, "probe": 1}
    assert by_label(got, "kvcanary_responses_total", "outcome") == {"ok": 1, "http_status": 1}
    assert by_label(got, "kvcanary_errors_total", "kind") == {"http_status": 1}
    assert by_label(got, "kvcanary_findings_total", "kind") == {"cross_tenant_canary": 1}
    assert got["kvcanary_ttft_seconds_count"] == {(("intent", "victim"),): 1.0}
    assert got["kvcanary_ttft_seconds_bucket"][(("intent", "victim"), ("le", "0.25"))] == 0
    assert got["kvcanary_ttft_seconds_bucket"][(("intent", "victim"), ("le", "0.5"))] == 1
    assert got["kvcanary_target_healthy"] == {(): 0.0}
    metrics.handle(TargetServing(t_wall=0.0, num_failed=3))
    assert samples(generate_latest(metrics.registry).decode())["kvcanary_target_healthy"] == {
        (): 1.0
    }


def test_a_quiet_log_still_gets_a_heartbeat_line() -> None:
    out = io.StringIO()
    display = ProgressDisplay(duration_s=60.0, file=out, live=False, interval_s=0.0)
    display.heartbeat()
    assert "heartbeat: phase - | 0 requests" in out.getvalue()
    quiet = ProgressDisplay(duration_s=60.0, file=out, live=False, interval_s=3600.0)
    quiet.heartbeat()  # a line was printed less than interval_s ago: nothing more
    assert out.getvalue().count("heartbeat") == 1


def gated_target(num_open: int, gate: threading.Event) -> Any:
    """The safe fake target, except that POSTs after the first `num_open` wait for `gate`:
    the run then stands still, so a scrape and the journal can be compared."""
    inner = fake_target()
    num_posts = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal num_posts
        if scope["method"] == "POST" and scope["path"].endswith("/completions"):
            num_posts += 1
            # +2: the calibration's two lengths
            while num_posts > num_open + 2 and not gate.is_set():
                await _sleep()
        await inner(scope, receive, send)

    return app


async def _sleep() -> None:
    import asyncio

    await asyncio.sleep(0.02)


@contextlib.contextmanager
def soak(argv: list[str]) -> Iterator[Any]:
    proc = _start(argv)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def wait_for(condition: Any, proc: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            value = condition()
            if value:
                return value
        assert proc.poll() is None, "the soak ended early"
        assert time.monotonic() < deadline, "the soak made no progress"
        time.sleep(0.05)


def test_a_soak_serves_metrics_that_match_its_journal(tmp_path: Path) -> None:
    out, port, gate = tmp_path / "soak", free_port(), threading.Event()
    num_open = 8
    with serve(gated_target(num_open, gate)) as url:
        argv = ["soak", "--target", url, *LIMIT_FLAGS, "--duration", "10m", "--out", str(out)]
        with soak([*argv, "--concurrency", "1", "--metrics-port", str(port)]) as proc:

            def settled() -> dict[str, Any] | None:
                got = scrape(port)
                done = sum(by_label(got, "kvcanary_responses_total", "outcome").values())
                return got if done == num_open else None

            def held() -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
                """The next request planned, counted and held at the gate: from then on
                nothing can move, so the journal and the metrics are compared at rest."""
                try:
                    got, rows = scrape(port), records(out)
                except ValueError:  # a journal line half written
                    return None
                sent = sum(by_label(got, "kvcanary_requests_total", "intent").values())
                num_plans = len(of_type(rows, "plan"))
                return (got, rows) if sent == num_plans == num_open + 1 else None

            wait_for(settled, proc)
            got, rows = wait_for(held, proc)  # no sleep: a loaded machine only takes longer
            plans, observations = of_type(rows, "plan"), of_type(rows, "observation")
            assert by_label(got, "kvcanary_requests_total", "intent") == Counter(
                p["intent"] for p in plans
            )
            assert len(plans) == num_open + 1  # the one held at the gate
            outcomes = Counter(o["error_kind"] or "ok" for o in observations)
            assert by_label(got, "kvcanary_responses_total", "outcome") == outcomes
            errors = Counter(o["error_kind"] for o in observations if o["error_kind"])
            assert by_label(got, "kvcanary_errors_total", "kind") == errors
            assert by_label(got, "kvcanary_findings_total", "kind") == Counter(
                f["kind"] for f in of_type(rows, "finding")
            )
            answered = [o for o in observations if o.get("t_first_token_ns")]
            num_ttft = sum(got.get("kvcanary_ttft_seconds_count", {}).values())
            assert num_ttft == len(answered) > 0
            assert got["kvcanary_target_healthy"] == {(): 1.0}
            gate.set()
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=120)
    assert f"metrics: http://127.0.0.1:{port}/metrics" in err
    with pytest.raises(urllib.error.URLError):  # the endpoint went with the run
        scrape(port)


def soak_stays_up(tmp_path: Path, minutes: int) -> None:
    """A soak of `minutes` at 4 requests/s, scraped every `minutes / 20` min (every minute
    for 20 minutes): up, healthy and still counting each time; reports re-rendered and the
    journal rotated every quarter of it; it ends by its duration, every plan answered."""
    out, port = tmp_path / "soak", free_port()
    every_s = minutes * 60 / 20
    quarter = f"{minutes * 15}s"
    with serve(fake_target(delay_s=0.01)) as url:
        argv = ["soak", "--target", url, *LIMIT_FLAGS, "--duration", f"{minutes}m"]
        extra = ["--rate", "4", "--report-every", quarter, "--rotate-every", quarter]
        with soak([*argv, "--out", str(out), *extra, "--metrics-port", str(port)]) as proc:
            last = 0
            deadline = time.monotonic() + minutes * 60 - 2 * every_s
            wait_for(lambda: scrape(port), proc)  # the endpoint is up
            while time.monotonic() < deadline:
                time.sleep(every_s)
                got = scrape(port)
                sent = sum(by_label(got, "kvcanary_requests_total", "intent").values())
                assert sent > last, "the soak stopped sending"
                assert got["kvcanary_target_healthy"] == {(): 1.0}
                last = sent
            _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    rows = records(out)
    assert rows[-1]["type"] == "run_finished"
    assert rows[-1]["reason"] == "duration"
    assert len(of_type(rows, "plan")) == len(of_type(rows, "observation")) >= last
    assert len(list(out.glob("journal.0*.jsonl"))) >= 3  # rotated every quarter
    assert "report updated" in err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_2_minute_soak_stays_up_and_keeps_counting(tmp_path: Path) -> None:
    soak_stays_up(tmp_path, 2)


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_a_20_minute_soak_stays_up_and_keeps_counting(tmp_path: Path) -> None:
    soak_stays_up(tmp_path, 20)

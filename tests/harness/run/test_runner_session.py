"""Session wiring that the whole-run tests do not reach: the server tokenizer bridge, run
directories, and a run that fails with an error."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from kvcanary.canaries import RemoteTokenizer
from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.record.events import Event, RunFinished
from kvcanary.harness.run.config import resolve
from kvcanary.harness.run.out_dir import default_out_dir, prepare_run_dir
from kvcanary.harness.run.runner import Budget
from kvcanary.harness.target.tokenizer import ServerTokenizer


def tokenize_route(request: httpx.Request) -> httpx.Response:
    if request.url.path != "/v1/tokenize":
        return httpx.Response(404)
    tokens = list(range(len(json.loads(request.content)["prompt"].split())))
    return httpx.Response(200, json={"tokens": tokens, "count": len(tokens)})


async def test_the_server_tokenizer_counts_through_the_loop_from_a_worker_thread() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(tokenize_route)) as http:
        remote = RemoteTokenizer(http, "http://target.test")
        tokenizer = ServerTokenizer(remote, asyncio.get_running_loop(), "http://target.test")
        assert await asyncio.to_thread(tokenizer.count, "three word text") == 3
        assert await asyncio.to_thread(tokenizer.encode, "a b") == [0, 1]
        assert tokenizer.name == "server:http://target.test"
        with pytest.raises(AssertionError, match="would block"):
            tokenizer.count("on the loop thread")


async def test_a_failing_tokenize_route_ends_the_run_with_one_line() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    async with httpx.AsyncClient(transport=httpx.MockTransport(broken)) as http:
        remote = RemoteTokenizer(http, "http://target.test", style="sglang")
        tokenizer = ServerTokenizer(remote, asyncio.get_running_loop(), "http://target.test")
        with pytest.raises(RunIncomplete, match="tokenize route failed"):
            await asyncio.to_thread(tokenizer.count, "text")


def test_default_run_dirs_are_timestamped_and_unique(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    now = datetime(2026, 9, 14, 3, 4, 5, tzinfo=UTC)
    first = default_out_dir(now)
    assert first == Path("kvcanary-runs/20260914T030405Z")
    first.mkdir(parents=True)
    assert default_out_dir(now) == Path("kvcanary-runs/20260914T030405Z-1")
    out, identity = prepare_run_dir(resolve("run", {"seed": 9}))
    assert out.parent == Path("kvcanary-runs")
    assert not out.exists()  # created by the journal when the run starts
    assert identity.seed == 9
    assert not identity.resumed


def test_a_soak_without_a_run_started_record_cannot_resume(tmp_path: Path) -> None:
    (tmp_path / "journal.jsonl").write_text('{"type":"phase","phase":"fill","t_wall":0}\n')
    with pytest.raises(ConfigError, match="no run_started"):
        prepare_run_dir(resolve("soak", {"duration": 5.0, "out": str(tmp_path)}))


async def test_a_run_that_fails_journals_run_finished_with_the_error() -> None:
    from test_runner import FakeSender, make_runner

    class Broken(FakeSender):
        async def send(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
            raise RuntimeError("a bug in the client")

    events: list[Event] = []
    runner = make_runner(Broken(), events.append, budget=Budget(5))
    with pytest.raises(RuntimeError, match="a bug in the client"):
        await runner.run()
    assert isinstance(events[-1], RunFinished)
    assert events[-1].reason == "error"
    assert "a bug in the client" in (events[-1].message or "")

"""`--ray`: the tenants' requests built, sent and scanned by Ray actors on a local 2-CPU Ray
instance (bound to 127.0.0.1, a small object store, its own temp dir).

The actors build the prompts the driver would build and scan with one index of every
tenant's live canaries between them, so the same seed must give the same plans and the
same findings as one process, fragments of another tenant's canaries included; an actor
killed mid-run must end only the requests it had in flight, journaled as `worker_lost`, and
Ray's restart carries on.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_openai import (
    LIMIT_FLAGS,
    POOL,
    Receive,
    Scope,
    Send,
    json_response,
    models_or_404,
    num_prompt_tokens,
    read_body,
    sse_event,
    sse_finish,
    sse_start,
)
from local_ray import local_ray as sandboxed_ray
from misbehaving_server import serve
from test_cli_run import fake_target

from kvcanary.harness.cli import main
from kvcanary.harness.record.observation import Observation
from kvcanary.harness.run import out_dir
from kvcanary.harness.run.ray_kit import rebased
from kvcanary.harness.run.ray_sender import ACTOR_PREFIX

ray = pytest.importorskip("ray", reason="--ray needs Ray (the dev extra installs it)")
pytestmark = pytest.mark.slow

SMALL_CONTEXT = 1024


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray instance for the module (a run reuses an initialised Ray and leaves
    it running, so the instance's start-up is paid once)."""
    with sandboxed_ray():
        yield


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


def _findings(out: Path) -> list[tuple[Any, ...]]:
    return sorted(
        (r["kind"], r["request_id"], r["tenant"], json.dumps(r.get("owner"), sort_keys=True))
        for r in _rows(out)
        if r["type"] == "finding"
    )


def _records(out: Path, kind: str) -> list[str]:
    """The journal's records of `kind`, but their wall-clock times, in a stable order."""
    rows = [r for r in _rows(out) if r["type"] == kind]
    return sorted(json.dumps({k: v for k, v in r.items() if k != "t_wall"}) for r in rows)


def test_timestamps_move_onto_the_drivers_clock_and_keep_their_differences() -> None:
    obs = Observation("t0-r000001", "tenant-0", 200, 0.0, 1_000, 1_500, 2_000, 3_000, 9_000)
    moved = rebased(obs, 10_000)
    assert (moved.t_scheduled_ns, moved.t_sent_ns, moved.t_done_ns) == (11_000, 11_500, 19_000)
    assert moved.ttft_ns == obs.ttft_ns
    assert moved.queue_ns == obs.queue_ns
    assert rebased(Observation("r", "t", None, 0.0, 5, 5), 1).t_first_token_ns is None


def _replaying_target(*, tags: bool = True) -> Any:
    """A deterministic leaky target: every streamed answer quotes the previous request's
    prompt, whoever sent it (at concurrency 1 the same seed gives the same leaks); without
    `tags`, with every canary's tag cut out, so only fragments of canaries leak."""
    previous = ""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal previous
        body = await read_body(receive)
        if scope["method"] == "GET":
            await models_or_404(scope, send)
            return
        request = json.loads(body)
        num_tokens = num_prompt_tokens(request)
        if num_tokens >= POOL:
            await json_response(send, 400, {"error": {"message": "too long"}})
            return
        usage = {"prompt_tokens": num_tokens, "completion_tokens": 4}
        if not request.get("stream", True):
            answer = {"choices": [{"index": 0, "text": " word"}], "usage": usage}
            await json_response(send, 200, answer)
            return
        quoted, previous = previous[:600], request["prompt"]
        if not tags:
            quoted = quoted.replace("ydk ", "")
        await sse_start(send)
        for i in range(0, len(quoted), 150):
            await sse_event(send, {"choices": [{"index": 0, "text": quoted[i : i + 150]}]})
        await sse_finish(send, usage)

    return app


@pytest.mark.parametrize("tags", [True, False], ids=["whole canaries", "fragments"])
def test_the_same_seed_gives_the_same_plans_and_findings_as_one_process(
    tmp_path: Path, local_ray: None, tags: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole canaries attribute themselves with the run key on any actor; fragments of
    another tenant's canaries are found through the actors that hold them live. The run id
    is pinned, so both runs have the same key (it derives from the seed and the run id) and
    their journals can be compared record by record."""
    monkeypatch.setattr(out_dir, "new_run_id", lambda: "20260101T000000Z-abcdef")
    args = ["run", *LIMIT_FLAGS, "--seed", "11", "--requests", "40", "--concurrency", "1"]
    outs = {}
    for how, extra in (("local", []), ("ray", ["--ray"])):
        outs[how] = tmp_path / how
        with serve(_replaying_target(tags=tags)) as url:
            status = main([*args, *extra, "--target", url, "--out", str(outs[how])])
        assert status == 1  # the replaying target leaks either way
    found = _records(outs["local"], "finding")
    layers = {json.loads(record)["details"].get("layer") for record in found}
    assert any('"cross_tenant_canary"' in record for record in found), found
    assert layers == ({"exact"} if tags else {"fragment"}), layers
    assert _records(outs["ray"], "finding") == found
    # the actors build the prompts the driver would: the same canaries, the same hashes
    assert _records(outs["ray"], "plan") == _records(outs["local"], "plan")


def test_a_ray_run_finds_the_bundled_engines_leak_as_one_process_does(
    tmp_path: Path, local_ray: None
) -> None:
    """On the bundled engine, with the same seed, a Ray run sends the same plans and gets
    the same verdict, the leak found by content and protocol, and the same `unsafe_accept`s
    (those follow from the plans and the engine's admission alone) as one process. Which
    stale page a
    probe reads depends on how soon it follows the last request's release (page release
    races the next allocation), so the content findings' owners may differ in detail."""
    from kvcanary.reference_engine.server.launch import running_engine

    args = ["--seed", "5", "--requests", "24", "--concurrency", "1"]
    outs = {how: tmp_path / how for how in ("local", "ray")}
    for how, out in outs.items():
        extra = ["--ray"] if how == "ray" else []
        with running_engine("vulnerable", context_length=SMALL_CONTEXT) as engine:
            run = ["run", "--target", str(engine.base_url), *args, *extra, "--out", str(out)]
            assert main(run) == 1, how

    def plans(out: Path) -> list[tuple[Any, ...]]:
        rows = [r for r in _rows(out) if r["type"] == "plan"]
        # the canaries differ (each run mints under a fresh random key); the plans do not
        return [(r["request_id"], r["tenant"], r["intent"], r["num_prompt_tokens"]) for r in rows]

    def accepted_over_limit(out: Path) -> set[str]:
        return {request for kind, request, *_ in _findings(out) if kind == "unsafe_accept"}

    assert plans(outs["ray"]) == plans(outs["local"])
    kinds = {how: {kind for kind, *_ in _findings(out)} for how, out in outs.items()}
    for how in outs:  # found by content and by protocol either way
        assert {"cross_tenant_canary", "unsafe_accept"} <= kinds[how], kinds
    # the timing detector's findings depend on the machine's load, not on who sends
    assert accepted_over_limit(outs["ray"]) == accepted_over_limit(outs["local"])
    verdicts = {
        how: json.loads((out / "summary.json").read_text())["verdict"] for how, out in outs.items()
    }
    assert verdicts == {"local": "leak", "ray": "leak"}


def test_a_killed_actor_fails_its_requests_and_the_run_finishes(
    tmp_path: Path, local_ray: None
) -> None:
    out = tmp_path / "run"
    statuses: list[int] = []
    args = ["run", *LIMIT_FLAGS, "--requests", "80", "--concurrency", "4", "--ray"]
    with serve(fake_target(delay_s=0.1)) as url:
        thread = threading.Thread(
            target=lambda: statuses.append(main([*args, "--target", url, "--out", str(out)]))
        )
        thread.start()
        try:
            victim = _actor_of("tenant-1", out, thread)
            os.kill(ray.get(victim.pid.remote()), signal.SIGKILL)
        finally:
            thread.join(timeout=240)
    assert statuses == [0], statuses  # a lost worker is no finding about the target
    rows = _rows(out)
    plans = Counter(r["request_id"] for r in rows if r["type"] == "plan")
    observations = [r for r in rows if r["type"] == "observation"]
    assert Counter(r["request_id"] for r in observations) == plans
    assert len(plans) == 80
    lost = [r for r in observations if r["error_kind"] == "worker_lost"]
    assert lost
    assert {r["tenant"] for r in lost} == {"tenant-1"}
    last_lost = max(i for i, r in enumerate(observations) if r["error_kind"] == "worker_lost")
    later = [r for r in observations[last_lost + 1 :] if r["tenant"] == "tenant-1"]
    assert any(r["error_kind"] is None for r in later), "the restarted actor sent nothing"
    assert rows[-1]["type"] == "run_finished"
    assert rows[-1]["reason"] == "completed"


def _actor_of(tenant: str, out: Path, run: threading.Thread) -> Any:
    """The actor sending `tenant`'s requests, once the run has observed a few of them."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and run.is_alive():
        journal = out / "journal.jsonl"
        if journal.exists() and journal.read_text().count('"type":"observation"') >= 8:
            names = [
                name
                for name in ray.util.list_named_actors()
                if name.startswith(f"{ACTOR_PREFIX}{tenant}-")
            ]
            if names:
                return ray.get_actor(names[0])
        time.sleep(0.05)
    raise AssertionError("the run ended, or observed no request within 180 s")


def test_an_address_nothing_answers_at_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["run", *LIMIT_FLAGS, "--target", "http://127.0.0.1:9", "--ray", "127.0.0.1:9"])
    printed = capsys.readouterr()
    assert status == 2
    assert "--ray 127.0.0.1:9: nothing answers at 127.0.0.1:9" in printed.err
    assert "Traceback" not in printed.err


def test_an_address_that_is_no_ray_is_refused_before_anything_is_written_or_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A web server where Ray should be (a dashboard's port, a typo): refused in one line
    before the journal exists and before the target sees a request, so the same --out can
    be used again."""
    num_requests = 0
    inner = fake_target()

    async def counting(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal num_requests
        num_requests += 1
        await inner(scope, receive, send)

    out = tmp_path / "run"
    with serve(counting) as url, serve(fake_target()) as not_ray:
        address = not_ray.removeprefix("http://")
        argv = ["run", *LIMIT_FLAGS, "--ray", address, "--target", url, "--out", str(out)]
        status = main(argv)
    printed = capsys.readouterr()
    assert status == 2
    assert f"--ray {address}: {address} answers as a web server (HTTP/1), not as Ray" in (
        printed.err
    )
    assert "Traceback" not in printed.err
    assert not (out / "journal.jsonl").exists()
    assert num_requests == 0

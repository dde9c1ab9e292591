"""Foreign text in what a target sends back as an error is redacted like response text.

A broken deployment may quote another customer's data in a 5xx body or an error event (here:
the previous request's prompt, and a planted phrase). By default none of it is written in
clear anywhere: journal, summary, reports, evidence, stdout, stderr; `--keep-raw-evidence`
keeps it raw in the journal only (DESIGN: raw text never goes into reports or the console).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from misbehaving_server import read_body, serve

from kvcanary.harness.cli import main

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

PLANTED = "ANOTHER-CUSTOMERS-NOTE-zebra-quartz"
LIMIT_FLAGS = ["--pool-tokens", "384", "--context-tokens", "768", "--model", "fake"]


def quoting_target() -> Any:
    """Answers every POST with an error that quotes the planted phrase and the previous
    request's prompt: HTTP 500 for one request, an SSE `error` event after 200 the next."""
    previous = ""
    num_posts = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal previous, num_posts
        body = await read_body(receive)
        if scope["method"] != "POST":
            await _answer(send, 404, "application/json", b"{}")
            return
        request = json.loads(body)
        prompt = request.get("prompt") or request["messages"][0]["content"]
        quoted = json.dumps({"error": {"message": f"{PLANTED} while serving: {previous}"}})
        previous, num_posts = prompt, num_posts + 1
        if num_posts % 2 or not request.get("stream"):
            await _answer(send, 500, "application/json", quoted.encode())
        else:
            event = f"event: error\ndata: {quoted}\n\n".encode()
            await _answer(send, 200, "text/event-stream", event)

    return app


async def _answer(send: Send, status: int, content_type: str, body: bytes) -> None:
    headers = [(b"content-type", content_type.encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("raw", [False, True], ids=["default", "keep-raw-evidence"])
def test_foreign_text_in_error_bodies_is_never_written_in_clear_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], raw: bool
) -> None:
    out = tmp_path / "run"
    argv = ["run", *LIMIT_FLAGS, "--requests", "16", "--concurrency", "1", "--out", str(out)]
    argv += ["--keep-raw-evidence"] if raw else []
    with serve(quoting_target()) as url:
        status = main([*argv, "--target", url])
    printed = capsys.readouterr()
    assert status == 3, printed  # every request failed: inconclusive
    assert "Traceback" not in printed.err
    assert PLANTED not in printed.out
    assert PLANTED not in printed.err
    files = {p.relative_to(out).as_posix(): p.read_text() for p in out.rglob("*") if p.is_file()}
    assert {"journal.jsonl", "summary.json", "report.html", "report.md", "junit.xml"} <= set(files)
    for name, text in files.items():
        # --keep-raw-evidence keeps the target's words in the journal and evidence/ (0600)
        if not (raw and (name == "journal.jsonl" or name.startswith("evidence/"))):
            assert PLANTED not in text, name
    observations = [
        json.loads(line)
        for line in files["journal.jsonl"].splitlines()
        if '"type":"observation"' in line
    ]
    # abort plans drop the connection after the response head, before any body is read
    observations = [o for o in observations if o["error_kind"] != "disconnected"]
    errors = [o["error"] for o in observations]
    assert {o["error_kind"] for o in observations} == {"http_status", "error_in_success"}
    if raw:
        assert all(PLANTED in e for e in errors)  # kept, for the person who asked for it
    else:
        # what went wrong stays readable; the target's words become a length and a hash
        assert all(" chars redacted, sha256:" in e for e in errors), errors
        assert any(e.startswith("HTTP 500: [… ") for e in errors)
        assert any(e.startswith("ErrorInSuccess: error event in stream: [… ") for e in errors)
    assert "HTTP 500: [… " in printed.err  # the target-unhealthy line, redacted either way

"""`kvcanary run` / `soak` end to end against small fake targets on loopback ports.

The fake target is a safe OpenAI-compatible server: it counts prompt tokens in cl100k_base,
rejects prompts at or above its limit with 400, and streams a short answer with exact
usage. Runs against it must be clean; runs against a target that fails every request must
end inconclusive (exit 3) with every error journaled; usage errors exit 2; Ctrl-C and a
killed process leave a journal that accounts for every request but those in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_openai import (
    CONTEXT,
    ENCODING,
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
from misbehaving_server import serve

from kvcanary.harness.cli import main
from kvcanary.harness.run import rendering
from kvcanary.harness.run.phases import default_phases
from kvcanary.harness.run.session import SOAK_CYCLE_S

__all__ = ["CONTEXT", "ENCODING", "LIMIT_FLAGS", "POOL", "Receive", "Scope", "Send"]


def fake_target(
    *,
    delay_s: float = 0.0,
    status: int | None = None,
    echo_auth: bool = False,
    die_after: int | None = None,
    hang_after: int | None = None,
) -> Any:
    """A safe target (or, with `status`, one that answers every POST with that status; with
    `echo_auth`, one that quotes the Authorization header back in errors and answers; with
    `die_after`, one whose worker dies after that many requests: 503 from then on; with
    `hang_after`, one whose worker hangs after that many: `/health` says 503, and requests
    are never answered)."""
    num_posts = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal num_posts
        assert scope["type"] == "http"
        body = await read_body(receive)
        if scope["method"] == "GET":
            if scope["path"] == "/health" and hang_after is not None:
                hung = num_posts > hang_after
                status_ = 503 if hung else 200
                await json_response(send, status_, {"status": "dead" if hung else "ok"})
            else:
                await models_or_404(scope, send)
            return
        if status is not None:
            await json_response(send, status, {"error": {"message": "internal error"}})
            return
        num_posts += 1
        if hang_after is not None and num_posts > hang_after:
            await asyncio.Event().wait()  # until the client gives up and disconnects
        if die_after is not None and num_posts > die_after:
            await json_response(send, 503, {"error": {"message": "CB worker is dead"}})
            return
        request = json.loads(body)
        num_tokens = num_prompt_tokens(request)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode() if echo_auth else ""
        if num_tokens >= POOL:
            message = f"{num_tokens} tokens is too long (request had {auth})"
            await json_response(send, 400, {"error": {"message": message}})
            return
        if not request.get("stream", True):  # the calibration request: answered at once
            usage = {"prompt_tokens": num_tokens, "completion_tokens": 1}
            answer = {"choices": [{"index": 0, "text": " word"}], "usage": usage}
            await json_response(send, 200, answer)
            return
        await sse_start(send)
        for i in range(4):
            await asyncio.sleep(delay_s)
            text = f" word{i}" + (f" {auth}" if auth and i == 0 else "")
            await sse_event(send, {"choices": [{"index": 0, "text": text, "finish_reason": None}]})
        await sse_finish(send, {"prompt_tokens": num_tokens, "completion_tokens": 4})

    return app


EXIT_WAIT_S = 180
"""How long a signalled run may take to exit: generous, since waiting longer never weakens
what is asserted about how it ended (a loaded machine renders reports slowly)."""


def soak_phase_at(elapsed_s: float, duration_s: float) -> str:
    """The phase a soak's schedule gives `elapsed_s` into a `duration_s` budget."""
    cycle_s = min(SOAK_CYCLE_S, duration_s)
    fraction, bound = (elapsed_s % cycle_s) / cycle_s, 0.0
    phases = default_phases(0.5)
    for phase in phases:
        bound += phase.share
        if fraction < bound:
            return phase.name
    return phases[-1].name


def records(out: Path) -> list[dict[str, Any]]:
    lines = []
    for path in sorted(out.glob("journal*.jsonl"), key=lambda p: (p.name == "journal.jsonl", p)):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def of_type(rows: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["type"] == kind]


# -- usage errors: exit 2, one line ----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--requests", "5", "--duration", "10s"], "requests and duration"),
        (["run", "--concurrency", "2", "--rate", "1"], "concurrency and rate"),
        (["soak", "--target", "http://127.0.0.1:9"], "soak needs --duration"),
        (["run", "--profile", "nope", "--target", "http://127.0.0.1:9"], "unknown workload"),
        (["run", "--tenants", "1"], "at least 2"),
        (
            ["run", "--target", "http://127.0.0.1:9", "--engine-fix", "page_tags"],
            "only without --target",
        ),
        (
            ["run", "--target", "http://127.0.0.1:9", "--api-key-env", "KVCANARY_TEST_UNSET"],
            "KVCANARY_TEST_UNSET is not set",
        ),
        # before the bundled engine starts (it takes seconds), not after
        (["run", "--page-size", "8", "--strict-page-size"], "only pages of at least 13 tokens"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "out" / "journal.jsonl").exists()
    assert not (tmp_path / "out").exists()  # a run that fails validation leaves nothing


def test_a_config_file_nested_5000_deep_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvcanary.toml"
    config.write_text("[run]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    assert main(["run", "--config", str(config)]) == 2
    assert "nested too deeply" in capsys.readouterr().err


def test_bad_flag_values_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--duration", "5 parsecs"])
    assert exit_info.value.code == 2
    assert "--duration" in capsys.readouterr().err


def test_a_bad_config_file_key_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvcanary.toml"
    config.write_text("[run]\ntenants = 3\nconcurency = 4\n")
    assert main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "unknown key `concurency` in [run]" in err
    assert str(config) in err


def test_an_unreachable_target_exits_3_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the run: nothing listens there
    assert main(["run", "--target", f"http://127.0.0.1:{port}", "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"kvcanary: run incomplete: cannot reach the target at http://127.0.0.1:{port}"
    )
    assert not any("Traceback" in line for line in err)


# -- whole runs against fake targets ---------------------------------------------------


def test_a_safe_target_is_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    config = tmp_path / "kvcanary.toml"
    with serve(fake_target()) as url:
        config.write_text(
            f'[run]\ntarget = "{url}"\nrequests = 60\nconcurrency = 4\n'
            f"pool-tokens = {POOL}\ncontext-tokens = {CONTEXT}\n"
        )
        status = main(["run", "--config", str(config), "--tenants", "3", "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 0, printed
    assert printed.out.startswith("verdict: CLEAN")
    for name in ("journal.jsonl", "summary.json", "report.html", "report.md", "junit.xml"):
        assert (out / name).exists()
        assert str(out / name) in printed.out
    rows = records(out)
    assert rows[0]["type"] == "run_started"
    assert rows[0]["settings"]["tenants"] == 3  # the flag over the file's default
    assert rows[0]["settings"]["num_workers"] == 4  # from the file
    assert rows[0]["settings"]["num_requests"] == 60
    assert rows[0]["limits"]["pool_tokens"] == POOL
    assert rows[-1] == {
        **rows[-1],
        "type": "run_finished",
        "reason": "completed",
        "num_requests": 60,
    }
    observations = of_type(rows, "observation")
    assert len(observations) == len(of_type(rows, "plan")) == 60
    assert not of_type(rows, "finding")
    assert {o["status"] for o in observations} == {200, 400}
    # abort plans drop their connection after the response head: nothing to redact
    assert all(o["text_redacted"] for o in observations if o["status"] == 200 and o["text"])
    assert json.loads((out / "summary.json").read_text())["verdict"] == "clean"


def test_a_target_failing_every_request_ends_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serve(fake_target(status=500)) as url:
        status = main(
            ["run", "--target", url, *LIMIT_FLAGS, "--requests", "30", "--out", str(tmp_path)]
        )
    printed = capsys.readouterr()
    assert status == 3
    assert "Traceback" not in printed.err
    assert printed.out.startswith("verdict: INCONCLUSIVE")
    observations = of_type(records(tmp_path), "observation")
    assert len(observations) == 30
    assert {(o["status"], o["error_kind"]) for o in observations} == {(500, "http_status")}


# -- interruption, kill, soak (separate processes) -------------------------------------


def _start(argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvcanary", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        **kwargs,
    )


def _wait_for_lines(out: Path, kind: str, count: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while True:
        journal = out / "journal.jsonl"
        if journal.exists():
            text = journal.read_text()
            if text.count(f'"type":"{kind}"') >= count:
                return
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.05)


@contextlib.contextmanager
def _running(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    proc = _start(argv)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_ctrl_c_stops_sending_and_reports_what_was_seen(tmp_path: Path) -> None:
    with (
        serve(fake_target(delay_s=0.05)) as url,
        _running(
            ["run", "--target", url, *LIMIT_FLAGS, "--requests", "5000", "--out", str(tmp_path)]
        ) as proc,
    ):
        _wait_for_lines(tmp_path, "observation", 8, proc)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=EXIT_WAIT_S)
    assert proc.returncode == 3, stderr  # interrupted during the fill phase: no verdict
    assert "interrupted: no new requests" in stderr
    assert "verdict: INCONCLUSIVE" in stdout
    assert "(run interrupted)" in stdout
    assert "Traceback" not in stderr
    rows = records(tmp_path)
    assert rows[-1]["type"] == "run_finished"
    assert rows[-1]["reason"] == "interrupted"
    assert len(of_type(rows, "plan")) == len(of_type(rows, "observation")) < 5000
    assert (tmp_path / "report.html").exists()


def test_a_second_ctrl_c_cancels_requests_in_flight(tmp_path: Path) -> None:
    with (
        serve(fake_target(delay_s=30)) as url,
        _running(["run", "--target", url, *LIMIT_FLAGS, "--out", str(tmp_path)]) as proc,
    ):
        _wait_for_lines(tmp_path, "plan", 8, proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=EXIT_WAIT_S)
    assert proc.returncode == 3, stderr
    rows = records(tmp_path)
    kinds = {o["error_kind"] for o in of_type(rows, "observation")}
    assert kinds == {"cancelled"}
    assert len(of_type(rows, "observation")) == len(of_type(rows, "plan")) == 8
    assert rows[-1]["reason"] == "interrupted"
    assert (tmp_path / "report.html").exists()  # cancelled requests are still reported
    assert "Traceback" not in stderr


def test_sigterm_while_the_reports_are_written_says_how_to_render_them(tmp_path: Path) -> None:
    """A CI job's timeout sends SIGTERM; during rendering it must not lose the reports
    silently: either they were written, or one line says how to write them."""
    with (
        serve(fake_target(delay_s=0.01)) as url,
        _running(
            ["run", "--target", url, *LIMIT_FLAGS, "--requests", "30", "--out", str(tmp_path)]
        ) as proc,
    ):
        _wait_for_lines(tmp_path, "run_finished", 1, proc)
        ended_before = proc.poll() is not None
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=EXIT_WAIT_S)
    assert "Traceback" not in stderr
    if ended_before:
        assert (tmp_path / "report.html").exists()
        return
    rendered = (tmp_path / "report.html").exists() and proc.returncode in (0, 1, 3)
    unrendered = proc.returncode == 3 and f"run `kvcanary report {tmp_path}`" in stderr
    assert rendered or unrendered, (proc.returncode, stderr)


def test_a_sigterm_while_the_process_shuts_down_keeps_its_exit_status(tmp_path: Path) -> None:
    """Once the status is decided, a SIGTERM that lands while the interpreter shuts down
    (seconds on a loaded machine, after the reports were written) must not turn it into
    "killed by SIGTERM" (143): the window the test above hits only by chance."""
    late_sigterm = (
        "import atexit, os, runpy, signal; "
        "atexit.register(os.kill, os.getpid(), signal.SIGTERM); "  # during the shutdown
        "runpy.run_module('kvcanary', run_name='__main__')"
    )
    argv = [sys.executable, "-c", late_sigterm, "report", str(tmp_path / "missing")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=EXIT_WAIT_S)
    assert proc.returncode == 2, proc.stderr  # the usage error's status, not -SIGTERM
    assert "is not a directory" in proc.stderr


def test_a_killed_run_loses_at_most_the_requests_in_flight(tmp_path: Path) -> None:
    with (
        serve(fake_target(delay_s=0.02)) as url,
        _running(
            [
                "run",
                "--target",
                url,
                *LIMIT_FLAGS,
                "--requests",
                "5000",
                "--concurrency",
                "6",
                "--out",
                str(tmp_path),
            ]
        ) as proc,
    ):
        _wait_for_lines(tmp_path, "observation", 40, proc)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    rows = records(tmp_path)  # every line is whole JSON: records() would raise otherwise
    planned = {r["request_id"] for r in of_type(rows, "plan")}
    observed = {r["request_id"] for r in of_type(rows, "observation")}
    assert observed <= planned
    assert len(planned - observed) <= 6
    assert rows[-1]["type"] != "run_finished"


def test_soak_reports_rotates_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "soak"

    def in_the_soaks_process(*args: object) -> None:
        raise AssertionError("a soak rendered in its own process")

    # every render of a soak, the final one included, is a child's (its memory stays flat)
    monkeypatch.setattr(rendering, "render_here", in_the_soaks_process)
    with serve(fake_target(delay_s=0.01)) as url:
        argv = [
            "soak",
            "--target",
            url,
            *LIMIT_FLAGS,
            "--duration",
            "3s",
            "--report-every",
            "1s",
            "--rotate-every",
            "1s",
            "--concurrency",
            "2",
            "--seed",
            "5",
            "--out",
            str(out),
        ]
        assert main(argv) == 0
        first = capsys.readouterr()
        assert "report updated" in first.err
        assert "journal segment closed" in first.err
        assert list(out.glob("journal.0001.jsonl"))
        rows = records(out)
        first_ids = [r["request_id"] for r in of_type(rows, "plan")]
        assert rows[-1]["reason"] == "duration"
        summary = json.loads((out / "summary.json").read_text())  # the final render's
        assert summary["counts"]["requests"]["total"] == len(first_ids)

        # the same --out again, with a longer duration: the soak continues where it stopped
        longer = [*argv[: argv.index("--duration") + 1], "6s", *argv[argv.index("3s") + 1 :]]
        assert main(longer) == 0
        rows = records(out)
        second = [i for i, r in enumerate(rows) if r["type"] == "run_started"][1]
        phases = [r["phase"] for r in rows[second:] if r["type"] == "phase"]
        # it continues at the phase the schedule gives for the time the first session used
        # (about 3 of 6 s: probe on an idle machine, later under load), never at fill again
        begun = rows[second]["settings"]["elapsed_before_s"]
        first_phase = next(r for r in rows[second:] if r["type"] == "phase")
        reached = begun + first_phase["t_wall"] - rows[second]["t_wall"]
        assert phases[0] in {soak_phase_at(begun, 6.0), soak_phase_at(reached, 6.0)}, phases
        assert phases[0] != "fill", phases
        assert rows[second]["settings"]["elapsed_before_s"] >= 2.5
        ids = [r["request_id"] for r in of_type(rows, "plan")]
        assert ids[: len(first_ids)] == first_ids
        assert len(ids) > len(first_ids)
        assert len(set(ids)) == len(ids)  # numbering continued, nothing reused
        started = of_type(rows, "run_started")
        assert len(started) == 2
        assert started[0]["run_id"] == started[1]["run_id"]
        assert started[1]["settings"]["resumed"] is True
        assert rows[-1]["num_requests"] == len(ids)
        capsys.readouterr()

        other = [
            "soak",
            "--target",
            url + "/other",
            *LIMIT_FLAGS,
            "--duration",
            "1s",
            "--out",
            str(out),
        ]
        assert main(other) == 2
        assert "use another --out, or --force" in capsys.readouterr().err
        assert main([*argv[:-2], "--seed", "6", "--out", str(out)]) == 2
        assert main([*other, "--force"]) in (0, 3)


@pytest.mark.parametrize("raw", [False, True], ids=["redacted", "keep-raw-evidence"])
def test_a_credential_the_target_echoes_back_is_never_written_or_printed(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    raw: bool,
) -> None:
    key = "sk-proj-PLANTEDKEY0123456789abcdef"
    monkeypatch.setenv("KVCANARY_TEST_KEY", key)
    out = tmp_path / "run"
    argv = ["run", *LIMIT_FLAGS, "--api-key-env", "KVCANARY_TEST_KEY", "--requests", "30"]
    argv += ["--keep-raw-evidence"] if raw else []
    with serve(fake_target(echo_auth=True)) as url:
        main([*argv, "--target", url, "--out", str(out)])
    printed = capsys.readouterr()
    assert key not in printed.out
    assert key not in printed.err
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "journal.jsonl" for p in files)
    for path in files:
        assert key.encode() not in path.read_bytes(), path
    journal = (out / "journal.jsonl").read_text()
    if raw:
        assert "[credential redacted]" in journal  # the echo was there, and was scrubbed
    else:  # the error bodies quoting it are the target's words: a length and a hash
        assert " chars redacted, sha256:" in journal


def test_a_target_that_hangs_is_seen_dead_by_its_health_route(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Requests that time out say nothing about health by themselves (a long prefill is not
    a dead target), nor does a failing `/health` (llama.cpp's stalls under load); requests
    that time out while `/health` answers 503 do: they stopped completing."""
    out = tmp_path / "run"
    argv = ["run", *LIMIT_FLAGS, "--requests", "16", "--concurrency", "2", "--timeout", "3s"]
    with serve(fake_target(hang_after=8)) as url:
        status = main([*argv, "--target", url, "--out", str(out)])
    printed = capsys.readouterr()
    assert status == 3, printed
    assert "the target's health route failed 2 polls in a row (GET /health: HTTP 503)" in (
        printed.err
    )
    assert (
        "the target stopped serving: 5 requests in a row failed or timed out while its "
        "health route failed too"
    ) in printed.err
    (recorded,) = of_type(records(out), "health_route_failed")
    assert recorded["last_error"] == "GET /health: HTTP 503"
    (unhealthy,) = of_type(records(out), "target_unhealthy")
    assert unhealthy["source"] == "health"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_unhealthy"]["source"] == "health"
    assert summary["verdict"] == "inconclusive"
    timeouts = [o for o in of_type(records(out), "observation") if o["error_kind"] == "timeout"]
    assert timeouts  # the hung requests, which alone would not have said it


def test_a_target_that_dies_mid_run_is_reported_and_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["run", *LIMIT_FLAGS, "--requests", "40", "--concurrency", "2", "--out", str(out)]
    with serve(fake_target(die_after=12)) as url:
        status = main([*argv, "--target", url])
    printed = capsys.readouterr()
    assert "the target stopped serving: 5 requests in a row failed" in printed.err
    assert "(last: HTTP 503: [… " in printed.err  # the target's words redacted
    assert "CB worker is dead" not in printed.err
    rows = records(out)
    (unhealthy,) = of_type(rows, "target_unhealthy")
    assert unhealthy["num_failed"] == 5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target_unhealthy"]["num_failed"] >= 5
    assert summary["verdict"] == "inconclusive"
    assert status == 3
    assert "stopped serving" in printed.out  # the verdict line says why


def test_a_full_disk_mid_journal_stops_the_run_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcanary.harness.record.journal import JournalWriter

    real_write = JournalWriter.write
    num_writes = 0

    def write(self: JournalWriter, event: Any, line: bytes | None = None) -> None:
        nonlocal num_writes
        num_writes += 1
        if num_writes > 25:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, event, line)

    monkeypatch.setattr(JournalWriter, "write", write)
    out = tmp_path / "run"
    with serve(fake_target()) as url:
        status = main(["run", "--target", url, *LIMIT_FLAGS, "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 3
    assert "cannot write the journal" in err
    assert "No space left on device" in err
    assert "Traceback" not in err
    rows = records(out)  # what was written is whole
    assert len(rows) == 25


def test_run_refuses_an_out_that_holds_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "journal.jsonl").write_text("")
    assert main(["run", "--target", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: (p / "old").mkdir() or (p / "old" / "evidence.json").write_text("{}"),
         "is not empty"),
        (lambda p: (p / "file").write_text("x"), "is a file, not a directory"),
    ],
    ids=["not-empty", "under-a-file"],
)  # fmt: skip
def test_run_refuses_an_unusable_out_before_contacting_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Any, message: str
) -> None:
    make(tmp_path)
    out = tmp_path / "old" if message == "is not empty" else tmp_path / "file" / "run"
    argv = ["run", "--target", "http://127.0.0.1:9", *LIMIT_FLAGS, "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert "target" not in err.split("error:")[0]  # refused before the target was contacted
    assert not (out / "journal.jsonl").exists()

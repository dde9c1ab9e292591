"""`kvcanary run` against every fault kind of the test fault servers, end to end: the exit
status DESIGN gives that fault, no traceback on any output, every planned request journaled
exactly once (a plan and one observation each), and peak memory bounded.

The client-level `tests/harness/target/test_fault_injection.py` checks each fault's error
kind; this is the same table through the command a user runs. To keep it cheap the runs are
made by two long-lived driver processes (this file run as a script), each calling
`harness.cli.main` once per fault with fds 1 and 2 redirected to a file, so the imports are
paid once per driver. Memory is the driver's peak RSS during one run (`VmHWM`, reset before
each run through `/proc/self/clear_refs`; the cumulative `ru_maxrss` where that is not
available), bounded against the same driver's run of the well-formed `keepalive` fault with a
wide margin: a client that buffered a 200 MB body or a 4 GiB gzip bomb exceeds it many times.
Nothing here compares times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import resource
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
RSS_MARGIN_KIB = 128 * 1024
"""Above the `keepalive` run's peak: far more than the noise measured between faults (4 MiB),
less than any one unbounded read of the faults (200 MB and up)."""
DRIVERS = 2
RESULT_WAIT_S = 240.0
ANSWER = "fault-cli-answer "
"""Marks the driver's answer lines on its stdout."""
LIMITS = ("--pool-tokens", "384", "--context-tokens", "768")
SMALL_RUN = ("--requests", "4", "--concurrency", "4", "--seed", "16")
HANG_TIMEOUT = "1s"
"""For the faults that never answer: what they cost in waiting."""
ANSWER_TIMEOUT = "60s"
"""For every other fault: an answer is never late, however loaded the machine."""

# how a case is run: `model` (--model and the limits given: completions only), `no_model`
# (limits given: /v1/models is read for the name), `discover` (nothing given: every endpoint)
Mode = str


@dataclasses.dataclass(frozen=True)
class Case:
    fault: str
    mode: Mode
    exit: int
    """DESIGN's exit status: 1 only where the findings are correct about this fault."""
    errors: str | None = None
    """The error kind every observation carries (None: clean observations, or no run)."""
    message: str | None = None
    """A regex the one-line error on stderr must match (runs that end before sending)."""
    findings: str | None = None
    """The one finding kind of an exit-1 run."""

    @property
    def timeout(self) -> str:
        hangs = self.errors == "timeout" or "hang" in self.fault
        return HANG_TIMEOUT if hangs else ANSWER_TIMEOUT

    @property
    def id(self) -> str:
        return self.fault if self.mode == "model" else f"{self.fault}-{self.mode}"


# error faults of a completion: every request fails, so no victim was answered: inconclusive
_ERRORS = {
    "malformed": "protocol",
    "truncated": "truncated",
    "missing_done": "truncated",
    "reset": "truncated",
    "status_500": "http_status",
    "status_400": "http_status",
    "status_429": "http_status",
    "status_429_retry_after": "http_status",
    "status_503_retry_after": "http_status",
    "status_500_gzip": "http_status",
    "html_500": "http_status",
    "not_sse": "protocol",
    "redirect": "http_status",
    "hang": "timeout",
    "hang_mid_stream": "timeout",
    "trickle_1bps": "timeout",
    "usage_huge": "protocol",
    "usage_negative": "protocol",
    "usage_float": "protocol",
    "usage_string": "protocol",
    "usage_list": "protocol",
    "deep_json": "protocol",
    "huge": "too_large",
    "huge_line": "too_large",
    "body_200mb": "too_large",
    "gzip_bomb": "too_large",
    "deflate_bomb": "too_large",
}
# readable answers without usage counts: within the limits and nothing wrong, so clean
_CLEAN = ("keepalive", "cr_lines", "surrogate", "gzip_ok")

CASES: list[Case] = [
    # it counts words, not cl100k tokens: a configuration error found by calibration, exit 2
    # naming --tokenizer, never a prompt_tokens_mismatch finding on every answer
    Case(
        "ok",
        "model",
        2,
        message=r"counts \d+ prompt tokens where --tokenizer cl100k_base .*--tokenizer PATH",
    ),
    *(Case(fault, "model", 3, errors=kind) for fault, kind in _ERRORS.items()),
    *(Case(fault, "model", 0) for fault in _CLEAN),
    # an error inside a 200 stream is a finding (a protocol defect, not a leak): no victim
    # was answered, so still inconclusive
    Case("error_after_200", "model", 3, "error_in_success", findings="error_in_success"),
    Case("error_event", "model", 3, "error_in_success", findings="error_in_success"),
    # discovery: the name is read from /v1/models; its read's own reason is in the one line
    Case("models_hang", "no_model", 3, message=r"cannot reach the target .*within 1 s"),
    Case("all_hang", "no_model", 3, message=r"cannot reach the target .*within 1 s"),
    Case("models_huge", "no_model", 2, message=r"lists no model \(body larger than \d+ bytes"),
    Case("models_gzip_bomb", "no_model", 2, message=r"lists no model \(body larger than"),
    Case("models_deep", "no_model", 2, message=r"lists no model \(JSON nested deeper than"),
    Case("metrics_huge", "no_model", 2, message=r"lists no model"),
    Case("models_surrogate", "no_model", 3, "http_status"),  # the name m\ufffd is not served
    # discovery of everything: a limit is missing and must be given
    *(
        Case(fault, "discover", 2, message=r"pass --pool-tokens")
        for fault in ("models_huge", "models_gzip_bomb", "models_deep", "metrics_huge")
    ),
    Case("all_hang", "discover", 3, message=r"cannot reach the target .*within 1 s"),
]


def _argv(case: Case, root: str, out: Path) -> list[str]:
    argv = ["run", "--target", f"{root}/{case.fault}", *SMALL_RUN, "--out", str(out)]
    argv += ["--timeout", case.timeout]
    if case.mode != "discover":
        argv += LIMITS
    if case.mode == "model":
        argv += ["--model", "fake"]
    return argv


# -- the driver (this file run as a script) ----------------------------------------------


def _peak_kib() -> int:
    try:
        status = Path("/proc/self/status").read_text()
        found = re.search(r"VmHWM:\s+(\d+) kB", status)
        if found:
            return int(found.group(1))
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _drive() -> None:
    """Read one JSON argv per line on stdin; run it; answer one JSON line on the real stdout."""
    from kvcanary.harness.cli import main

    answers = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        argv = json.loads(line)
        with tempfile.TemporaryFile("w+") as captured:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(captured.fileno(), 1)
            os.dup2(captured.fileno(), 2)
            _reset_peak()
            try:
                rc: int | str = main(argv)
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else 2
            except BaseException:
                traceback.print_exc()
                rc = "exception"
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
            peak = _peak_kib()
            captured.seek(0)
            output = captured.read()
        answer = {"rc": rc, "output": output, "peak_kib": peak}
        answers.write(ANSWER + json.dumps(answer) + "\n")
        answers.flush()


# -- the test side ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    rc: int | str
    output: str
    peak_kib: int
    baseline_kib: int
    out: Path


class Drivers:
    """`DRIVERS` driver processes working through one queue of cases, `keepalive` (a whole
    run, clean) first in each."""

    def __init__(self, root: str, tmp: Path, cases: list[Case]) -> None:
        self._root = root
        self._tmp = tmp
        self._jobs: queue.Queue[Case | None] = queue.Queue()
        self.results: dict[str, Future[Outcome]] = {case.id: Future() for case in cases}
        for case in cases:
            self._jobs.put(case)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._procs = [
            subprocess.Popen(
                [sys.executable, __file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=tmp,
            )
            for _ in range(DRIVERS)
        ]
        self._threads = [
            threading.Thread(target=self._work, args=(n, proc), daemon=True)
            for n, proc in enumerate(self._procs)
        ]
        for thread in self._threads:
            thread.start()

    def _call(
        self, n: int, proc: subprocess.Popen[str], case: Case, name: str | None = None
    ) -> dict[str, Any]:
        out = self._tmp / f"driver{n}-{name or case.id}"
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write(json.dumps(_argv(case, self._root, out)) + "\n")
        proc.stdin.flush()
        stray = []  # the driver's own output outside a run (a traceback in it fails the case)
        while not (line := proc.stdout.readline()).startswith(ANSWER):
            if not line:
                raise RuntimeError(f"driver {n} died during {case.id}: {''.join(stray)}")
            stray.append(line)
        answer: dict[str, Any] = json.loads(line.removeprefix(ANSWER))
        answer["output"] = "".join(stray) + answer["output"]
        answer["out"] = out
        return answer

    def _work(self, n: int, proc: subprocess.Popen[str]) -> None:
        broken: Exception | None
        try:
            baseline = self._call(n, proc, Case("keepalive", "model", 0), "baseline")["peak_kib"]
        except Exception as exc:
            baseline, broken = 0, exc  # every case of this driver fails with it
        else:
            broken = None
        while (case := self._jobs.get()) is not None:
            future = self.results[case.id]
            if broken is not None:
                future.set_exception(broken)
                continue
            try:
                answer = self._call(n, proc, case)
            except Exception as exc:
                broken = exc
                future.set_exception(exc)
                continue
            future.set_result(
                Outcome(answer["rc"], answer["output"], answer["peak_kib"], baseline, answer["out"])
            )

    def close(self) -> None:
        for _ in self._procs:
            self._jobs.put(None)
        for proc in self._procs:
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for thread in self._threads:
            thread.join(timeout=30)


def _selected(request: pytest.FixtureRequest) -> list[Case]:
    """The cases this session will run (all of them unless some were deselected)."""
    wanted = {
        item.callspec.id
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
    }
    return [case for case in CASES if case.id in wanted] or CASES


@pytest.fixture(scope="module")
def drivers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Drivers]:
    sys.path.insert(0, str(HERE.parent / "target"))
    import fault_server
    import misbehaving_server

    with misbehaving_server.serve(fault_server.app) as root:
        running = Drivers(root, tmp_path_factory.mktemp("faults"), _selected(request))
        try:
            yield running
        finally:
            running.close()


def _journal(out: Path) -> list[dict[str, Any]]:
    path = out / "journal.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_table_covers_every_fault_kind() -> None:
    sys.path.insert(0, str(HERE.parent / "target"))
    import fault_server
    import misbehaving_server

    kinds = {*misbehaving_server.FAULTS, *fault_server.COMPLETION_FAULTS}
    kinds |= set(fault_server.DISCOVERY_FAULTS)
    assert kinds == {case.fault for case in CASES}
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_fault_ends_in_its_exit_status_with_every_request_journaled(
    drivers: Drivers, case: Case
) -> None:
    outcome = drivers.results[case.id].result(timeout=RESULT_WAIT_S)
    shown = f"{case.id}: exit {outcome.rc}\n{outcome.output[-3000:]}"
    assert "Traceback" not in outcome.output, shown
    assert outcome.rc == case.exit, shown
    bound = outcome.baseline_kib + RSS_MARGIN_KIB
    assert outcome.peak_kib <= bound, (
        f"{case.id}: peak RSS {outcome.peak_kib // 1024} MiB, the keepalive run's "
        f"{outcome.baseline_kib // 1024} MiB"
    )
    lines = [line for line in outcome.output.splitlines() if line.startswith("kvcanary: ")]
    if case.message is not None:
        assert lines, shown
        assert re.search(case.message, lines[-1]), shown

    records = _journal(outcome.out)
    planned = [r["request_id"] for r in records if r["type"] == "plan"]
    observed = [r for r in records if r["type"] == "observation"]
    if case.message is not None:  # ended before anything was sent: no run directory
        assert not outcome.out.exists(), shown
        return
    assert planned, shown
    assert len(set(planned)) == len(planned), f"{case.id}: a request planned twice"
    assert sorted(r["request_id"] for r in observed) == sorted(planned), shown
    finished = [r for r in records if r["type"] == "run_finished"]
    assert [r["num_requests"] for r in finished] == [len(planned)], shown
    kinds = {r["error_kind"] for r in observed}
    assert kinds == {case.errors}, f"{case.id}: error kinds {kinds}"
    findings = {r["kind"] for r in records if r["type"] == "finding"}
    assert findings == ({case.findings} if case.findings else set()), shown
    assert (outcome.out / "summary.json").exists(), shown


if __name__ == "__main__":
    _drive()

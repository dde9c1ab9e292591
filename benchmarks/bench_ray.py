"""`kvcanary run --ray`: the driver's CPU per request, apart from its actors', against the same
run in one process.

Each measured run is `kvcanary run` (the CLI, every detector and the journal on) in a child
process against one OpenAI-compatible SSE server that answers at once
(`benchmarks/instant_server.py`, its own process), N streamed completions at concurrency C,
`--tenants T`; with `--ray`, on a local Ray instance the child starts (2 CPUs, bound to
127.0.0.1, a small object store, its own temp dir), so the T actors, the driver and the
server share this machine's cores. Reported per mode (median of the rounds, modes
alternating):

    req/s, in flight   over the run window, from the journal's own stamps
    driver CPU         `Runner.run`'s process time (all threads: Ray's own included) per
                       request: with `--ray` the schedule, the Ray calls, the journal writes
                       and the timing and protocol detectors; in one process, everything
    actors CPU         the actors' processes' CPU over the same window (/proc), per request:
                       prompts built, sent, scanned, redacted, encoded
    per Ray call       requests carried per exchange (`RaySender.num_exchanges`)
    driver ceiling     1 s / driver CPU per request: the requests/s one driver core can
                       coordinate, however many actors send them

    .venv/bin/python benchmarks/bench_ray.py                       # 3 rounds, 2 tenants
    .venv/bin/python benchmarks/bench_ray.py --rounds 1 --requests 2000  # quick
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import instant_server
import run_peers

LIMIT = 500
"""Pool and context of the `below` profile's sizes (as `bench_run.py`): ~290-token prompts."""


def _actor_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/PID/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / ticks


def _timed(window: dict[str, Any], senders: list[Any]) -> None:
    """`Runner.run` timed into `window` (the driver's CPU, its loop thread's, the actors'),
    and the timing detector's refits; each `RaySender` made kept in `senders`."""
    from kvcanary.harness.detectors import timing
    from kvcanary.harness.run import ray_sender, runner

    window["refit_s"] = 0.0
    refit = timing.TimingDetector._refit

    def timed_refit(self: timing.TimingDetector) -> None:
        cpu = time.thread_time()  # on the event loop's thread
        try:
            refit(self)
        finally:
            window["refit_s"] += time.thread_time() - cpu

    made = ray_sender.RaySender.__init__

    def keep(self: ray_sender.RaySender, *a: Any, **k: Any) -> None:
        made(self, *a, **k)
        senders.append(self)

    run = runner.Runner.run

    async def timed(self: runner.Runner) -> runner.RunOutcome:
        pids = []
        if senders:
            import ray

            pids = ray.get([actor.pid.remote() for actor in senders[0].actors.values()])
        actors, wall, cpu = _actor_cpu_s(pids), time.perf_counter(), time.process_time()
        loop_cpu = time.thread_time()
        try:
            return await run(self)
        finally:
            window["cpu_s"] = time.process_time() - cpu
            window["loop_cpu_s"] = time.thread_time() - loop_cpu
            window["wall_s"] = time.perf_counter() - wall
            window["actors_cpu_s"] = _actor_cpu_s(pids) - actors

    ray_sender.RaySender.__init__ = keep  # type: ignore[method-assign]
    runner.Runner.run = timed  # type: ignore[method-assign]
    timing.TimingDetector._refit = timed_refit  # type: ignore[method-assign]


def child(url: str, out: str, args: argparse.Namespace, ray_mode: bool) -> dict[str, Any]:
    """One `kvcanary run` in this process: its runner timed, its actors' CPU read."""
    from kvcanary.harness.cli import main as cli

    window: dict[str, Any] = {}
    senders: list[Any] = []
    _timed(window, senders)
    argv = [
        *("run", "--target", url, "--requests", str(args.requests)),
        *("--concurrency", str(args.concurrency), "--tenants", str(args.tenants)),
        *("--tokenizer", "cl100k_base", "--seed", "7", "--profile", "below"),
        *("--pool-tokens", str(LIMIT), "--context-tokens", str(LIMIT), "--out", out),
    ]
    quiet = contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO())
    with _ray(ray_mode), quiet[0], quiet[1]:
        status = cli([*argv, *(["--ray"] if ray_mode else [])])
    spans = [
        (record["t_sent_ns"] / 1e9, record["t_done_ns"] / 1e9)
        for line in (Path(out) / "journal.jsonl").open("rb")
        if line.startswith(b'{"type":"observation"')
        and (record := json.loads(line))["t_done_ns"] is not None
    ]
    n = len(spans)
    result = {**run_peers.window_stats(spans), "status": status}
    result["driver_cpu_us"] = window["cpu_s"] / n * 1e6
    result["refits_us"] = window["refit_s"] / n * 1e6
    result["steady_cpu_us"] = (window["cpu_s"] - window["refit_s"]) / n * 1e6
    result["other_threads_us"] = (window["cpu_s"] - window["loop_cpu_s"]) / n * 1e6
    result["actors_cpu_us"] = window["actors_cpu_s"] / n * 1e6 if ray_mode else None
    result["per_call"] = n / senders[0].num_exchanges if senders else None
    return result


def _ray(ray_mode: bool) -> contextlib.AbstractContextManager[Any]:
    if not ray_mode:
        return contextlib.nullcontext()
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "harness" / "run"))
    from local_ray import local_ray

    return local_ray()


def measure(url: str, work: Path, args: argparse.Namespace, ray_mode: bool) -> dict[str, Any]:
    out = work / f"run-{time.monotonic_ns()}"
    command = [sys.executable, __file__, "child", url, str(out), "ray" if ray_mode else "local"]
    command += [str(args.requests), str(args.concurrency), str(args.tenants)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"child failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def markdown(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, loads: str) -> str:
    def median(mode: str, key: str) -> float | None:
        values = [r[key] for r in results[mode] if r.get(key) is not None]
        return statistics.median(values) if values else None

    lines = [
        f"{os.cpu_count()} CPUs, {args.requests} requests at concurrency {args.concurrency}, "
        f"{args.tenants} tenants, {args.rounds} round(s), load average {loads}",
        "",
        "| mode | req/s | in flight | driver CPU/request | actors CPU/request | requests per "
        "Ray call | driver ceiling |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in results:
        rate, flight, driver, actors, per_call = (
            median(mode, key)
            for key in ("req_s", "in_flight", "driver_cpu_us", "actors_cpu_us", "per_call")
        )
        lines.append(
            f"| {mode} | {rate or 0:,.0f} | {flight or 0:.1f} | {driver or 0:,.0f} µs | "
            + (f"{actors:,.0f} µs" if actors is not None else "n/a")
            + (f" | {per_call:.1f}" if per_call is not None else " | n/a")
            + f" | {1e6 / (driver or 1):,.0f} req/s |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        url, out, mode, requests, concurrency, tenants = sys.argv[2:8]
        args = argparse.Namespace(
            requests=int(requests), concurrency=int(concurrency), tenants=int(tenants)
        )
        print(json.dumps(child(url, out, args, mode == "ray")))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--tenants", type=int, default=2, help="= Ray actors")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = instant_server.free_port()
    server = instant_server.start(port)
    url = f"http://127.0.0.1:{port}"
    before = "/".join(f"{x:.1f}" for x in os.getloadavg())
    results: dict[str, list[dict[str, Any]]] = {"--ray": [], "one process": []}
    try:
        with tempfile.TemporaryDirectory(prefix="kvcanary-bench-ray-") as tmp:
            for number in range(args.rounds):
                for mode in (
                    ("--ray", "one process") if number % 2 == 0 else ("one process", "--ray")
                ):
                    result = measure(url, Path(tmp), args, mode == "--ray")
                    results[mode].append(result)
                    print(f"round {number + 1} {mode}: {json.dumps(result)}", flush=True)
        after = "/".join(f"{x:.1f}" for x in os.getloadavg())
        print(markdown(results, args, f"{before} -> {after}"))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()

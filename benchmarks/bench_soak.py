"""A soak of N requests against a server that answers at once: memory and disk per request.

Starts `benchmarks/instant_server.py`, then `kvcanary soak` in a child process (closed loop
at `--concurrency`, `--max-requests N` ends it cleanly, the journal rotated every
`--rotate-every`, the report re-rendered every `--report-every` in a child of its own), and
samples, twice a second, the soak's resident memory (RSS) and that of its render children
(every render, the final one included, runs in a child process: `harness.run.rendering`).
Closed segments are gzipped once 10 minutes old (`harness.run.journal_upkeep`); after the
soak the benchmark gzips the rest, for the disk a long soak settles at.

Reported: RSS at each tenth of the soak and after warm-up (the flatness: the largest RSS
from half to nine tenths of the soak against the RSS at a quarter; the last tenth holds the
final render's wait), the soak's own peak, the render children's peak, the
journal's bytes per request (as written, and with closed segments gzipped), how long the
journal work of a resume takes from the checkpoint against reading every segment, and the
final `kvcanary report`'s time and peak RSS.

    .venv/bin/python benchmarks/bench_soak.py                        # 10^5 requests
    .venv/bin/python benchmarks/bench_soak.py --requests 20000 --rotate-every 5s  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import instant_server

LIMIT = 500


def rss_mb(pid: int, field: str = "VmRSS") -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def soak(url: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        *(sys.executable, "-m", "kvcanary", "soak", "--target", url, "--out", str(out)),
        *("--duration", "24h", "--max-requests", str(args.requests), "--yes"),
        *("--concurrency", str(args.concurrency), "--tokenizer", "cl100k_base"),
        *("--pool-tokens", str(LIMIT), "--context-tokens", str(LIMIT), "--profile", "below"),
        *("--rotate-every", args.rotate_every, "--report-every", args.report_every),
    ]
    if args.keep_journal:
        command += ["--keep-journal", args.keep_journal]
    start = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    samples: list[tuple[float, float]] = []
    render_peak = 0.0
    while child.poll() is None:
        rss = rss_mb(child.pid)
        if rss is not None:
            samples.append((time.monotonic() - start, rss))
        for grandchild in children(child.pid):
            render_peak = max(render_peak, rss_mb(grandchild, "VmHWM") or 0.0)
        time.sleep(0.5)
    errors = child.stderr.read().decode() if child.stderr else ""
    if child.returncode not in (0, 1, 3):  # 3: the phases a long soak cycles were not all met
        raise RuntimeError(f"soak exited {child.returncode}:\n{errors[-2000:]}")
    return {"samples": samples, "render_peak_mb": render_peak, "wall_s": time.monotonic() - start}


def disk(out: Path, num_requests: int) -> dict[str, float]:
    """Bytes on disk per request once every closed segment is gzipped, as a soak leaves
    them once they are `COMPRESS_AFTER_S` old (the last few stay plain while it runs)."""
    from kvcanary.harness.record.journal import closed_segments
    from kvcanary.harness.record.segments import compress_segment

    plain = sum(p.stat().st_size for _, p in closed_segments(out))
    for _, path in closed_segments(out):
        compress_segment(path)
    closed = [p for _, p in closed_segments(out)]
    current = out / "journal.jsonl"
    total = sum(p.stat().st_size for p in closed) + current.stat().st_size
    plain_lines = sum(1 for _ in current.open("rb"))
    return {
        "plain_bytes_per_request": (plain + current.stat().st_size) / num_requests,
        "bytes_per_request": total / num_requests,
        "closed_bytes": sum(p.stat().st_size for p in closed),
        "current_bytes": current.stat().st_size,
        "current_lines": plain_lines,
        "num_closed": len(closed),
    }


def timed_child(code: str, *argv: str) -> tuple[float, float, str]:
    """Wall seconds, peak RSS (MB) and output of a child running `code`."""
    start = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert child.stdout is not None
    output = child.stdout.read().decode()
    _, _, usage = os.wait4(child.pid, 0)
    return time.monotonic() - start, usage.ru_maxrss / 1024, output.strip()


RESUME = """
import sys, time
from pathlib import Path
from kvcanary.harness.run.resume_state import ResumeState
start = time.monotonic()
state = ResumeState.load(Path(sys.argv[1]))
print(time.monotonic() - start, state.num_plans)
"""
REPORT = """
import sys
from pathlib import Path
from kvcanary.reports.render import render_run
print(render_run(Path(sys.argv[1])).verdict)
"""


def resume_times(out: Path) -> dict[str, float]:
    _, _, fast = timed_child(RESUME, str(out))
    checkpoint = out / "journal.checkpoint.json"
    aside = checkpoint.with_name("checkpoint.aside")
    checkpoint.rename(aside)
    try:
        _, _, slow = timed_child(RESUME, str(out))
    finally:
        aside.rename(checkpoint)
    (fast_s, fast_n), (slow_s, slow_n) = (map(float, x.split()) for x in (fast, slow))
    assert fast_n == slow_n, (fast_n, slow_n)
    return {"resume_checkpoint_s": fast_s, "resume_whole_journal_s": slow_s, "plans": fast_n}


def markdown(result: dict[str, Any], args: argparse.Namespace) -> str:
    samples = result["samples"]
    at = [samples[min(len(samples) - 1, len(samples) * i // 10)][1] for i in range(1, 11)]
    quarter = samples[len(samples) // 4][1]
    # flatness over the middle: the first quarter warms up, the last tenth ends the soak
    second_half = max(rss for _, rss in samples[len(samples) // 2 : len(samples) * 9 // 10])
    d = result["disk"]
    lines = [
        f"{args.requests:,} requests, concurrency {args.concurrency}, rotate every "
        f"{args.rotate_every}, report every {args.report_every}, {result['wall_s']:.0f} s, "
        f"load average {result['load']}",
        "",
        "| measure | value |",
        "|---|---:|",
        "| soak RSS at each tenth (MB) | " + " / ".join(f"{x:.0f}" for x in at) + " |",
        f"| soak RSS peak (MB) | {max(r for _, r in samples):.0f} |",
        f"| after warm-up: largest RSS from half to nine tenths - RSS at a quarter | "
        f"{second_half - quarter:+.0f} MB |",
        f"| render children's peak RSS (MB) | {result['render_peak_mb']:.0f} |",
        f"| journal per request, plain (as written) | {d['plain_bytes_per_request']:,.0f} B |",
        f"| journal on disk per request, closed segments gzipped | {d['bytes_per_request']:,.0f} B "
        f"({d['num_closed']} closed segments gzipped: {d['closed_bytes'] / 1e6:.1f} MB; "
        f"current plain: {d['current_bytes'] / 1e6:.1f} MB) |",
        f"| resume's journal work: checkpoint + current segment | "
        f"{result['resume_checkpoint_s']:.2f} s |",
        f"| resume's journal work: every segment (no checkpoint) | "
        f"{result['resume_whole_journal_s']:.2f} s |",
        f"| final `kvcanary report`: wall / peak RSS | {result['report_s']:.1f} s / "
        f"{result['report_rss_mb']:.0f} MB |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rotate-every", default="30s")
    parser.add_argument("--report-every", default="60s")
    parser.add_argument("--keep-journal", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    args = parser.parse_args()
    port = instant_server.free_port()
    server = instant_server.start(port)
    work = Path(tempfile.mkdtemp(prefix="kvcanary-bench-soak-"))
    out = work / "soak"
    try:
        before = "/".join(f"{x:.1f}" for x in os.getloadavg())
        result = soak(f"http://127.0.0.1:{port}", out, args)
        result["load"] = f"{before} -> " + "/".join(f"{x:.1f}" for x in os.getloadavg())
        print(json.dumps({"rss_samples_mb": [round(r) for _, r in result["samples"]]}))
        num_requests = json.loads((out / "summary.json").read_text())["counts"]["requests"]["total"]
        result["disk"] = disk(out, args.requests)
        result.update(resume_times(out))
        result["report_s"], result["report_rss_mb"], _ = timed_child(REPORT, str(out))
        print(f"summary: {num_requests} requests reported")
        print(markdown(result, args))
    finally:
        server.terminate()
        server.wait()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

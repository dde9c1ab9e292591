"""Report rendering time and peak memory on synthetic journals of 10^4 and 10^6 requests.

Each measurement runs in a fresh Python process, so peak RSS (`resource.getrusage`) belongs
to that step alone:

- `import`: import `reports.render` and do nothing (the fixed cost every step includes);
- `parse`: stream the journal through `harness.record.journal.read_journal` and count events (the
  baseline: no report can be faster than reading its journal once);
- `frames`: `reports.frames.load_frames` (the columnar tables);
- `render`: `reports.render.render_run`, all formats (summary.json, evidence/, report.md,
  junit.xml, report.html with its plots).

Figures are reported as ratios against `parse` from the same run. Usage:

    .venv/bin/python benchmarks/bench_reports.py [--sizes 10000,1000000] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("import", "parse", "frames", "render")


def child(step: str, run_dir: Path) -> None:
    """One measured step, in this (fresh) process; prints seconds and peak RSS as JSON."""
    from harness.record.journal import read_journal
    from reports.frames import load_frames
    from reports.render import render_run

    start = time.perf_counter()
    detail: dict[str, object] = {}
    if step == "parse":
        detail["num_events"] = sum(1 for _ in read_journal(run_dir))
    elif step == "frames":
        frames = load_frames(run_dir)
        detail["num_requests"] = len(frames.requests)
        detail["frame_mb"] = round(frames.requests.memory_usage(deep=True).sum() / 2**20, 1)
    elif step == "render":
        result = render_run(run_dir)
        assert not result.errors, result.errors
        detail["verdict"] = str(result.verdict)
        detail["num_findings"] = result.summary["counts"]["findings_total"]
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"seconds": seconds, "peak_mb": peak_mb, **detail}))


def measure(step: str, run_dir: Path) -> dict[str, float]:
    completed = subprocess.run(
        [sys.executable, __file__, "--child", step, str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    result: dict[str, float] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


def record_journal(run_dir: Path, num_requests: int) -> float:
    sys.path.insert(0, str(ROOT / "tests" / "reports"))
    from run_journals import synthetic_run  # the recorder the report tests use

    start = time.perf_counter()
    synthetic_run(run_dir, num_requests)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,1000000")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--child", nargs=2, metavar=("STEP", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-reports-"))
    print("| requests | journal MB | step | seconds | × parse | peak RSS MB | notes |")
    print("|---:|---:|---|---:|---:|---:|---|")
    for num_requests in (int(size) for size in args.sizes.split(",")):
        run_dir = workdir / f"run-{num_requests}"
        shutil.rmtree(run_dir, ignore_errors=True)
        record_s = record_journal(run_dir, num_requests)
        journal_mb = sum(p.stat().st_size for p in run_dir.glob("journal*.jsonl")) / 2**20
        results = {step: measure(step, run_dir) for step in STEPS}
        parse_s = results["parse"]["seconds"]
        for step in STEPS:
            result = results[step]
            notes = ", ".join(
                f"{key} {value}"
                for key, value in result.items()
                if key not in ("seconds", "peak_mb")
            )
            if step == "import":
                notes = f"recording the journal took {record_s:.1f} s"
            ratio = "" if step == "import" else f"{result['seconds'] / parse_s:.2f}"
            print(
                f"| {num_requests:,} | {journal_mb:,.1f} | {step} | {result['seconds']:.2f} "
                f"| {ratio} | {result['peak_mb']:,.0f} | {notes} |",
                flush=True,
            )
        shutil.rmtree(run_dir)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

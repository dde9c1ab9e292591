"""Report rendering time and peak memory on synthetic journals of 10^4 and 10^6 requests.

Each measurement runs in a fresh Python process, so peak RSS (`resource.getrusage`) belongs
to that step alone:

- `import`: import `reports.render` and do nothing (the fixed cost every step includes);
- `parse`: stream the journal through `harness.record.journal.read_journal` and count events
  (one event-by-event pass: what every report cost before `reports.journal_scan`);
- `frames`: `reports.frames.load_frames` (the columnar tables, through the fast path);
- `render`: `reports.render.render_run`, all formats (summary.json, evidence/, report.md,
  junit.xml, report.html with its plots);
- `render-events`: the same, with the fast path switched off (every read event by event);
- `render-baseline`: `render_run` of the `reports` package as committed at `--baseline`
  (default `HEAD`, extracted read-only with `git archive` into the work directory and put
  first on `PYTHONPATH`), on the same journal in the same run: today's figure.

Figures are reported as ratios against `parse` from the same run. Usage:

    .venv/bin/python benchmarks/bench_reports.py [--sizes 10000,1000000] [--workdir DIR]
        [--baseline REF | --baseline none] [--keep] [--steps import,frames,render,...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("import", "parse", "frames", "render", "render-events", "render-baseline")


def child(step: str, run_dir: Path) -> None:
    """One measured step, in this (fresh) process; prints seconds and peak RSS as JSON."""
    from kvcanary.harness.record.journal import read_journal
    from kvcanary.reports.frames import load_frames
    from kvcanary.reports.render import render_run

    start = time.perf_counter()
    detail: dict[str, object] = {}
    if step == "parse":
        detail["num_events"] = sum(1 for _ in read_journal(run_dir))
    elif step == "frames":
        frames = load_frames(run_dir)
        detail["num_requests"] = len(frames.requests)
        detail["frame_mb"] = round(frames.requests.memory_usage(deep=True).sum() / 2**20, 1)
    elif step in ("render", "render-events", "render-baseline"):
        if step == "render-events":
            _without_fast_path()
        result = render_run(run_dir)
        if step == "render-baseline":  # older code may fail on newer journals: say so
            if result.errors:
                detail["errors"] = sorted(result.errors)
        else:
            assert not result.errors, result.errors
        detail["verdict"] = str(result.verdict)
        detail["num_findings"] = result.summary["counts"]["findings_total"]
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"seconds": seconds, "peak_mb": peak_mb, **detail}))


def _without_fast_path() -> None:
    from kvcanary.reports import frames, journal_scan, render

    def slow(*args: object) -> Any:
        raise journal_scan.SlowPathNeeded("switched off by the benchmark")

    frames.request_frame = slow
    render.request_lines = slow


def baseline_reports(ref: str, workdir: Path) -> Path:
    """The `reports` package as committed at `ref`, extracted (read-only) under `workdir`."""
    target = workdir / f"baseline-{ref.replace('/', '_')}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", ref, "reports"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def measure(step: str, run_dir: Path, baseline: Path | None = None) -> dict[str, float]:
    env = dict(os.environ)
    if step == "render-baseline":
        assert baseline is not None
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(baseline), env.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, __file__, "--child", step, str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=env,
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
    parser.add_argument("--baseline", default="HEAD", help="git ref to compare with, or none")
    parser.add_argument(
        "--keep", action="store_true", help="keep the journals in --workdir and reuse them"
    )
    parser.add_argument(
        "--steps", default=",".join(STEPS), help="steps to measure (parse is always measured)"
    )
    parser.add_argument("--child", nargs=2, metavar=("STEP", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-reports-"))
    baseline = None if args.baseline == "none" else baseline_reports(args.baseline, workdir)
    chosen = {"parse", *args.steps.split(",")}
    steps = [
        step
        for step in STEPS
        if step in chosen and (baseline is not None or step != "render-baseline")
    ]
    print("| requests | journal MB | step | seconds | × parse | peak RSS MB | notes |")
    print("|---:|---:|---|---:|---:|---:|---|")
    for num_requests in (int(size) for size in args.sizes.split(",")):
        run_dir = workdir / f"run-{num_requests}"
        if args.keep and (run_dir / "journal.jsonl").exists():
            record_s = float("nan")  # recorded by an earlier run
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
            record_s = record_journal(run_dir, num_requests)
        journal_mb = sum(p.stat().st_size for p in run_dir.glob("journal*.jsonl")) / 2**20
        results = {}
        for step in steps:
            results[step] = measure(step, run_dir, baseline)
            print(f"<!-- {step}: {results[step]} -->", file=sys.stderr, flush=True)
        parse_s = results["parse"]["seconds"]
        for step in steps:
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
        if not args.keep:
            shutil.rmtree(run_dir)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

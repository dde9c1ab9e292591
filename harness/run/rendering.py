"""A run's reports rendered from its journal: here, or for soaks in a child process.

A render reads the whole journal into frames and imports pandas and matplotlib (~90 MB
before the first row); at 10^6 requests its peak is ~410 MB. A run's memory is bounded by
its settings, not its length, render peaks included, so a long run renders apart: a soak
always (its periodic reports and the final one), a run whose journal is over
`APART_ABOVE_BYTES`. The child (`python -m kvcanary.harness.run.rendering RUN_DIR`) renders
and prints what it wrote as one JSON line; the run's process never imports the reports. A
short run renders here: a child would cost it the imports again, for no memory saved.

Ctrl-C or SIGTERM (a CI job's timeout) while the reports are written leaves the journal
complete and says how to render them: a `RunIncomplete` (exit 3).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.record.journal import journal_segments
from kvcanary.harness.record.outputs import Summary
from kvcanary.harness.record.verdict import Verdict
from kvcanary.harness.run.interrupts import Delivery, sigterm_as_interrupt
from kvcanary.harness.run.progress import ProgressDisplay

APART_ABOVE_BYTES = 64 * 1024 * 1024
"""A journal this large (about 50,000 requests as written) is rendered in a child process."""


@dataclass(frozen=True, slots=True)
class Rendered:
    """What a render wrote, the run's summary and verdict, and what failed."""

    verdict: Verdict
    summary: Summary
    paths: dict[str, Path]
    """Format (`json`, `md`, `junit`, `html`, `evidence`) -> the file or directory written."""
    errors: dict[str, str]
    """Output or plot that failed -> a one-line reason."""


def render(
    out_dir: Path,
    *,
    keep_raw_evidence: bool,
    display: ProgressDisplay,
    apart: bool | None = None,
) -> Rendered:
    """The reports from the journal, in a child process when `apart` (None: when the journal
    is over `APART_ABOVE_BYTES`); an output that could not be written is noted, not raised."""
    if apart is None:
        apart = sum(_size(path) for path in journal_segments(out_dir)) > APART_ABOVE_BYTES
    incomplete = RunIncomplete(
        f"interrupted while writing the reports; the journal is complete: reports not "
        f"rendered; run `kvcanary report {out_dir}`"
    )
    delivery: Delivery | None = None
    try:
        with sigterm_as_interrupt() as delivery:
            if apart:
                result = _render_in_child(out_dir, keep_raw_evidence)
            else:
                result = render_here(out_dir, keep_raw_evidence)
    except KeyboardInterrupt:
        raise incomplete from None
    except ImportError:
        if delivery is None or not delivery.fired:
            raise
        raise incomplete from None  # the signal landed in a C extension's init (pandas)
    for name, error in result.errors.items():
        display.note(f"report output {name} could not be written: {error}")
    if result.errors:
        display.note(f"reports incomplete; when the cause is fixed run `kvcanary report {out_dir}`")
    return result


def render_here(out_dir: Path, keep_raw_evidence: bool) -> Rendered:
    """Render in this process (seconds of imports the first time: interruptible too)."""
    from kvcanary.reports.render import render_run

    result = render_run(out_dir, keep_raw_evidence=keep_raw_evidence)
    return Rendered(result.verdict, result.summary, dict(result.paths), dict(result.errors))


async def render_apart(out_dir: Path, *, keep_raw_evidence: bool) -> Rendered:
    """Render in a child process without blocking the event loop (a soak's periodic report;
    what the child says on stderr is kept for a failure)."""
    child = await asyncio.create_subprocess_exec(
        *_child_command(out_dir, keep_raw_evidence),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    output, errors = await child.communicate()
    return _child_result(child.returncode, output, errors)


def _render_in_child(out_dir: Path, keep_raw_evidence: bool) -> Rendered:
    with subprocess.Popen(
        _child_command(out_dir, keep_raw_evidence),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as child:
        try:
            output, errors = child.communicate()
        except BaseException:  # interrupted: the child's half-written outputs are its own temps
            child.kill()
            raise
    if child.returncode == 0:
        sys.stderr.write(errors.decode(errors="replace"))  # e.g. --keep-raw-evidence's notice
    return _child_result(child.returncode, output, errors)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # a segment deleted meanwhile (--keep-journal)
        return 0


def _child_command(out_dir: Path, keep_raw_evidence: bool) -> list[str]:
    command = [sys.executable, "-m", __name__, str(out_dir)]
    return [*command, "--keep-raw-evidence"] if keep_raw_evidence else command


_USER_ERROR = 2
"""The child's exit status for a `ConfigError` (no journal, not a directory)."""


def _child_result(status: int | None, output: bytes, errors: bytes) -> Rendered:
    if status == _USER_ERROR:
        raise ConfigError(errors.decode(errors="replace").strip())
    if status != 0:
        lines = errors.decode(errors="replace").strip().splitlines()
        raise RuntimeError(
            f"the report render exited {status}: {lines[-1] if lines else 'no message'}"
        )
    said = json.loads(output)
    return Rendered(
        Verdict(said["verdict"]),
        said["summary"],
        {name: Path(path) for name, path in said["paths"].items()},
        dict(said["errors"]),
    )


def main(argv: list[str]) -> int:
    """The child: render `RUN_DIR` and print what was written as one JSON line."""
    out_dir, keep_raw_evidence = Path(argv[0]), "--keep-raw-evidence" in argv[1:]
    try:
        result = render_here(out_dir, keep_raw_evidence)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return _USER_ERROR
    said = {
        "verdict": str(result.verdict),
        "summary": result.summary,
        "paths": {str(name): str(path) for name, path in result.paths.items()},
        "errors": {str(name): reason for name, reason in result.errors.items()},
    }
    print(json.dumps(said))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A run's output directory, and who the run in it is: fresh, or a soak being resumed.

`prepare_run_dir` picks the directory (`--out`, default `./kvcanary-runs/<UTC timestamp>`)
and returns the run's identity: its id, its seed, and where request numbering starts. A
directory that already holds a journal is refused by `run` and resumed by `soak`: the run id
and seed are taken from its first `run_started`, numbering continues after the highest
request number journaled, and a journal of another target or seed is refused without
`--force`.

It reads journals but never writes them, and knows nothing about targets or engines beyond
how the settings name them.
"""

from __future__ import annotations

import os
import random
import secrets
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.journal import journal_segments
from kvcanary.harness.run.config import RunConfig
from kvcanary.harness.run.resume_state import ResumeState

RUNS_DIR = "kvcanary-runs"


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """Who this session's run is."""

    run_id: str
    seed: int
    num_previous_requests: int
    """Requests journaled by earlier sessions of the same run (0 for a fresh run)."""
    next_request: int
    """The first request number this session plans (numbering continues on resume)."""
    resumed: bool
    elapsed_s: float = 0.0
    """Run time spent by earlier sessions (a resumed soak continues its clock from here)."""


def default_out_dir(now: datetime | None = None) -> Path:
    """`./kvcanary-runs/<UTC timestamp>`, made unique if two runs start in one second."""
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
    path = Path(RUNS_DIR) / stamp
    suffix = 1
    while path.exists():
        path = Path(RUNS_DIR) / f"{stamp}-{suffix}"
        suffix += 1
    return path


def prepare_run_dir(config: RunConfig) -> tuple[Path, RunIdentity]:
    """The output directory and the identity of the run to write.

    A new directory is not created here: the journal writer creates it (mode 0700) when the
    run starts, so a run that never starts (a typo in --target) leaves nothing behind.
    """
    if config.command == "soak":
        out_dir = _usable_out_dir(config.out)
        if out_dir.is_dir() and journal_segments(out_dir):
            return out_dir, _resume(out_dir, config)
    else:
        out_dir = fresh_out_dir(
            config.out,
            hint=" (a soak can be resumed with `kvcanary soak --out {out_dir}`)",
        )
    seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2**32)
    return out_dir, RunIdentity(new_run_id(), seed, 0, 0, resumed=False)


def fresh_out_dir(out: str | Path | None, *, hint: str = "") -> Path:
    """`out` (default: a new timestamped directory) if it holds no run, or nothing at all.

    A directory with other files is refused too: evidence files of an earlier run beside a
    new journal would be read as this run's.
    """
    out_dir = _usable_out_dir(out)
    if out_dir.is_dir() and journal_segments(out_dir):
        raise ConfigError(
            f"--out {out_dir} already holds a run; choose another directory"
            + hint.format(out_dir=out_dir)
        )
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise ConfigError(f"--out {out_dir} is not empty; choose a new or an empty directory")
    return out_dir


def _usable_out_dir(out: str | Path | None) -> Path:
    """`out` if a run could write there: checked before anything starts, created nothing."""
    out_dir = Path(out) if out is not None else default_out_dir()
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} exists and is not a directory")
    existing = out_dir
    while not existing.exists():  # the nearest ancestor that exists must be a writable dir
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out {out_dir}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out_dir}: {existing} is not writable")
    try:  # os.access says yes to root on read-only mounts and pseudo filesystems: try it
        os.rmdir(tempfile.mkdtemp(prefix=".kvcanary-probe-", dir=existing))
    except OSError as exc:
        raise ConfigError(f"--out {out_dir}: {existing} is not writable ({exc.strerror})") from None
    return out_dir


def new_run_id(now: datetime | None = None) -> str:
    """`<UTC timestamp>-<6 hex>`: sorts by start time, unique across machines."""
    return f"{(now or datetime.now(UTC)).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}"


def target_key(settings: dict[str, Any]) -> str:
    """What a resumed soak must match: the target URL, or the bundled engine and its fixes."""
    if settings.get("target"):
        return str(settings["target"])
    fixes = "+".join(settings.get("engine_fix") or ())
    return f"bundled engine {settings.get('engine_preset')}" + (f" ({fixes})" if fixes else "")


def _resume(out_dir: Path, config: RunConfig) -> RunIdentity:
    # from the checkpoint a soak writes at each rotation and the segments after it
    state = ResumeState.load(out_dir)
    started = state.started
    if started is None:
        raise ConfigError(f"--out {out_dir}: its journal has no run_started record to resume")
    mismatches = []
    recorded = target_key(started.settings)
    if recorded != target_key(config.to_record()):
        mismatches.append(f"target {recorded}")
    if config.seed is not None and config.seed != started.seed:
        mismatches.append(f"seed {started.seed}")
    if mismatches and not config.force:
        raise ConfigError(
            f"--out {out_dir} holds a run with {' and '.join(mismatches)}; use another --out, "
            "or --force to continue it anyway"
        )
    seed = config.seed if config.seed is not None else started.seed
    return RunIdentity(
        started.run_id,
        seed,
        state.num_plans,
        max(state.next_request, state.num_plans),
        resumed=True,
        elapsed_s=state.elapsed_s,
    )

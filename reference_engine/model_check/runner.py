"""Run spin over the PD handoff model (`pd_handoff.pml`): one check, one table cell, the table.

One check: the model's #defines (fix switches, the environment, the property) -> `spin -a`,
`gcc` pan.c (breadth-first, so a counterexample is a shortest one), run pan with a depth
bound, and on a violation replay the trail with `spin -t -p` (`trail.parse_steps`).

A counterexample class is an environment: the placeholder (#30233) sends requests of either
size and drops none; the mid-transfer abort (#35049) sends only prompts that fit and lets the
client drop request 0; `any` sends either size and lets either client drop. A cell checks the
leak property first (decode reads another request's KV), then the stronger one (decode reads a
page not written for its request), so a cell says `leak`, `unwritten read`, or nothing found.
Any other violation (a lost page, a request that never ends) is reported as what it is.

What it does not know: the engine. The model is a separate description of it; the replay of
a counterexample on the engine (`scenario.py`) is what ties them together.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvcanary.reference_engine.config import FIXES
from kvcanary.reference_engine.model_check.trail import Step, parse_steps, render

MODEL = Path(__file__).with_name("pd_handoff.pml")
MODEL_FIXES = (
    "admission_retire",
    "coverage_check",
    "kv_checksum",
    "page_tags",
    "zero_on_free",
    "deferred_release",
    "pool_covers_context",
)
"""The engine's fix switches the model has a parameter for (the others concern the prefix
cache, which the model leaves out)."""
assert set(MODEL_FIXES) <= set(FIXES)
DEPTH_BOUND = 2000
"""pan's search depth bound (-m): the model's longest run is a few hundred steps, so the
search is exhaustive; pan says when the bound was reached, and the check reports it."""
NUM_REQUESTS = 2
NUM_DECODE_PAGES = 3


@dataclass(frozen=True, slots=True)
class Environment:
    """What the clients may do: the sizes sent and which requests may be dropped."""

    name: str
    title: str
    allow_overpool: bool
    abort_mask: int


ENVIRONMENTS: dict[str, Environment] = {
    "placeholder": Environment("placeholder", "#30233 placeholder", True, 0),
    "abort": Environment("abort", "#35049 mid-transfer abort", False, 1),
    "any": Environment("any", "any", True, (1 << NUM_REQUESTS) - 1),
}
PROPERTIES = {1: "leak", 2: "unwritten read"}


class ToolMissing(RuntimeError):
    """spin or gcc is not on PATH."""


@dataclass(frozen=True, slots=True)
class Check:
    """The outcome of one pan run."""

    fixes: frozenset[str]
    environment: str
    prop: int
    violation: str | None
    """What was violated (`leak`, `unwritten read`, `page lost`, ...), None if nothing."""
    message: str = ""
    """pan's own line for the violation."""
    steps: tuple[Step, ...] = ()
    num_states: int = 0
    bound_reached: bool = False


@dataclass(frozen=True, slots=True)
class Row:
    """One fix combination, one cell (a Check, or None if nothing found) per environment."""

    fixes: frozenset[str]
    cells: dict[str, Check] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.fixes:
            return "vulnerable"
        if self.fixes == frozenset(MODEL_FIXES):
            return "all fixes"
        return "+".join(fix for fix in MODEL_FIXES if fix in self.fixes)


def require_tools() -> None:
    """Raise ToolMissing unless spin and gcc are both available."""
    missing = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
    if missing:
        raise ToolMissing(
            f"{' and '.join(missing)} not found on PATH: `kvcanary verify` needs Debian's "
            "`spin` package and a C compiler (apt-get install spin gcc)"
        )


def defines(
    fixes: Iterable[str], environment: Environment, prop: int, release_timeout: bool = False
) -> list[str]:
    """The model's #defines for a check, as `-D` flags for spin."""
    chosen = set(fixes)
    unknown = chosen - set(MODEL_FIXES)
    assert not unknown, f"fixes the model has no parameter for: {sorted(unknown)}"
    values = {fix.upper(): int(fix in chosen) for fix in MODEL_FIXES}
    values |= {
        "ALLOW_OVERPOOL": int(environment.allow_overpool),
        "ALLOW_ABORT": environment.abort_mask,
        "RELEASE_TIMEOUT": int(release_timeout),
        "PROPERTY": prop,
        "N": NUM_REQUESTS,
    }
    return [f"-D{name}={value}" for name, value in values.items()]


def check(
    fixes: Iterable[str],
    environment: str,
    prop: int = 2,
    *,
    release_timeout: bool = False,
    model: Path = MODEL,
) -> Check:
    """One pan run of the model with `fixes` on, in `environment`, for property `prop`.

    `release_timeout`: deferred_release may give up waiting for the drain ack (its
    `release_timeout_s`); off in the table, which assumes the ack comes in time. `model`:
    another Promela file with the same parameters (tests check mutants of the model).
    """
    require_tools()
    fixes = frozenset(fixes)
    flags = defines(fixes, ENVIRONMENTS[environment], prop, release_timeout)
    with tempfile.TemporaryDirectory(prefix="kvcanary-spin-") as tmp:
        work = Path(tmp)
        shutil.copy(model, work / MODEL.name)
        _run(["spin", *flags, "-a", MODEL.name], work)
        _run(["gcc", "-O0", "-w", "-DSAFETY", "-DBFS", "-o", "pan", "pan.c"], work)
        out = _run(["./pan", f"-m{DEPTH_BOUND}"], work, check=False)
        violation, message = _violation(out)
        steps: tuple[Step, ...] = ()
        if violation is not None:
            replay = _run(["spin", "-t", "-p", *flags, MODEL.name], work, check=False)
            steps = tuple(parse_steps(replay))
        return Check(
            fixes,
            environment,
            prop,
            violation,
            message,
            steps,
            num_states=_num_states(out),
            bound_reached="max search depth too small" in out,
        )


def cell(fixes: Iterable[str], environment: str) -> Check:
    """The unwritten-read property; where its counterexample read nothing written (zeros),
    the leak property too, so that a cell says `leak` whenever one is reachable."""
    strict = check(fixes, environment, prop=2)
    if strict.violation != "unwritten read":
        return strict
    last_read = strict.steps[-1] if strict.steps else None
    if last_read is not None and last_read.reads_from not in (None, last_read.request):
        return dataclasses.replace(strict, violation="leak")
    leak = check(fixes, environment, prop=1)
    return leak if leak.violation is not None else strict


def table(
    rows: Sequence[frozenset[str]] | None = None,
    environments: Sequence[str] = ("placeholder", "abort"),
    max_workers: int = 2,
) -> list[Row]:
    """Every row's cells (default rows: vulnerable, each fix alone, all fixes)."""
    require_tools()
    rows = list(rows if rows is not None else default_rows())
    jobs = [(fixes, env) for fixes in rows for env in environments]
    if "any" not in environments:  # the full environment for the all-fixes row: the bound
        jobs += [(fixes, "any") for fixes in rows if fixes == frozenset(MODEL_FIXES)]
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        results = list(pool.map(lambda job: cell(*job), jobs))
    by_row: dict[frozenset[str], Row] = {fixes: Row(fixes) for fixes in rows}
    for (fixes, env), result in zip(jobs, results, strict=True):
        by_row[fixes].cells[env] = result
    return [by_row[fixes] for fixes in rows]


def default_rows() -> list[frozenset[str]]:
    return [frozenset(), *(frozenset({fix}) for fix in MODEL_FIXES), frozenset(MODEL_FIXES)]


def bound_text() -> str:
    """The stated bound every result holds within."""
    return (
        f"{NUM_REQUESTS} requests, {NUM_DECODE_PAGES} decode pages, 2 prefill pages, prompts of "
        f"1 or 2 pages, 2 decode steps, search depth {DEPTH_BOUND}"
    )


_VIOLATIONS = (
    (re.compile(r"assertion violated .*kv\[.*==0\)"), "leak"),
    (re.compile(r"assertion violated .*kv\["), "unwritten read"),
    (re.compile(r"assertion violated .*(owner\[pg\]|prefill_free)"), "page lost"),
    (re.compile(r"assertion violated .*owner\["), "page owned by two requests"),
    (re.compile(r"assertion violated .*ended"), "request never ended"),
    (re.compile(r"invalid end state"), "request never ends"),
    (re.compile(r"assertion violated"), "assertion"),
)


def _violation(pan_output: str) -> tuple[str | None, str]:
    line = next((ln for ln in pan_output.splitlines() if ln.startswith("pan:1:")), None)
    if line is None:
        return None, ""
    kind = next((name for pattern, name in _VIOLATIONS if pattern.search(line)), "error")
    return kind, line.removeprefix("pan:1: ").strip()


def _num_states(pan_output: str) -> int:
    found = re.search(r"([0-9.e+]+) states, stored", pan_output)
    return int(float(found.group(1))) if found else 0


def _run(argv: list[str], cwd: Path, *, check: bool = True) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    if check and done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr or done.stdout}")
    return done.stdout + done.stderr


def cell_text(result: Check) -> str:
    """A table cell: what was found, or `-` for nothing within the bound."""
    if result.violation is None:
        return "- (bound reached)" if result.bound_reached else "-"
    return result.violation


def _cell(row: Row, env: str) -> str:
    return cell_text(row.cells[env]) if env in row.cells else ""


def format_table(rows: Sequence[Row]) -> list[str]:
    """The table as aligned text lines, one row per fix combination."""
    envs = list(dict.fromkeys(env for row in rows for env in row.cells))
    header = ["fixes", *(ENVIRONMENTS[env].title for env in envs)]
    body = [[row.label, *(_cell(row, env) for env in envs)] for row in rows]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    return [
        "  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip()
        for line in (header, *body)
    ]


def trail_lines(rows: Sequence[Row]) -> list[str]:
    """Every counterexample of `rows`, a heading and its numbered steps each."""
    lines: list[str] = []
    for row in rows:
        for env, result in row.cells.items():
            if result.violation is not None:
                lines.append(f"\n{row.label}, {ENVIRONMENTS[env].title}: {result.violation}")
                lines += [f"  {line}" for line in render(result.steps, result.violation)]
    return lines

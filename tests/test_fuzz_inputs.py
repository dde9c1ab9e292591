"""Hostile inputs, fuzzed: random mutations of real journals, config files and scenario files.

Every loader must answer a broken file the way the CLI promises: a warning and a skipped
line, or one line and exit 2 (usage) or 3 (incomplete), never a traceback. The mutations
start from real files (a journal written by the recorder the report tests use, the config
file of the docs, the shipped scenarios) and break them as disks, editors and newer versions
do: values of the wrong type or far out of range, nesting deeper than any stack, unknown
fields, torn and duplicated lines, stray bytes.

Loaders are called in-process the way the CLI calls them, with its error mapping
(`ConfigError` -> 2, `RunIncomplete` -> 3); whatever else escapes fails the test with its
traceback. Each loader gets `NUM_EXAMPLES` examples; the whole `kvcanary report` command
(pandas frames and three renderers, ~0.3 s a call) gets `NUM_REPORT_EXAMPLES`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcanary.canaries.errors import ConfigError, RunIncomplete
from kvcanary.harness.cli import main
from kvcanary.harness.record.journal import read_journal
from kvcanary.harness.record.outputs import JOURNAL_NAME
from kvcanary.harness.record.verdict import EXIT_CLEAN, EXIT_INCOMPLETE, EXIT_USAGE
from kvcanary.harness.run.config import resolve
from kvcanary.harness.scenarios.schema import load_scenario
from kvcanary.reports.accounting import account_requests
from kvcanary.reports.journal_lines import SlowPathNeeded
from kvcanary.reports.journal_scan import rare_events

ROOT = Path(__file__).resolve().parents[1]
NUM_EXAMPLES = 1000
NUM_REPORT_EXAMPLES = 100
FUZZ = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples in every run: CI is never red by chance
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DEEP = "[" * 100_000 + "]" * 100_000
"""Nesting deeper than Python's stack (json and tomllib recurse)."""


def _recorder() -> Any:
    """tests/reports/run_journals.py, the recorder the report tests write journals with."""
    path = ROOT / "tests" / "reports" / "run_journals.py"
    spec = importlib.util.spec_from_file_location("run_journals", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("run_journals", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def journal_lines() -> list[bytes]:
    """A real journal's lines: the incident run (plans, observations, findings, a fit)."""
    with tempfile.TemporaryDirectory() as directory:
        run_dir = _recorder().vulnerable_run(Path(directory) / "run")
        return (run_dir / JOURNAL_NAME).read_bytes().splitlines(keepends=True)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """One directory the examples overwrite (a fresh one per example costs more than a load)."""
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory)


# -- mutations -------------------------------------------------------------------------------

json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.sampled_from([2**63, -(2**63) - 1, 2**63 - 1, 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 1e-300, 5e-324]),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=3),
    st.just(DEEP),
)


def _dump(value: Any) -> str:
    return DEEP if value == DEEP else json.dumps(value)


@st.composite
def mutated_record(draw: st.DrawFn, record: dict[str, Any]) -> bytes:
    """One journal record with a value replaced, a field added or removed (nested too)."""
    target = record
    nested = [key for key, value in record.items() if isinstance(value, dict) and value]
    if nested and draw(st.booleans()):
        target = record[draw(st.sampled_from(sorted(nested)))]
    keys = sorted(target)
    action = draw(st.sampled_from(["replace", "add", "remove"]))
    if action == "remove" and keys:
        del target[draw(st.sampled_from(keys))]
        replaced = None
        name = None
    else:
        name = draw(st.sampled_from(keys)) if action == "replace" and keys else draw(st.text())
        replaced = draw(json_values)
        target[name] = "\0marker\0"
    text = json.dumps(record, separators=(",", ":"))
    if name is not None:
        text = text.replace('"\\u0000marker\\u0000"', _dump(replaced))
    return text.encode() + b"\n"


@st.composite
def mutated_journal(draw: st.DrawFn, lines: list[bytes]) -> bytes:
    lines = list(lines)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        index = draw(st.integers(min_value=0, max_value=len(lines) - 1))
        action = draw(
            st.sampled_from(["record", "record", "record", "raw", "cut", "copy", "drop", "byte"])
        )
        line = lines[index]
        record = _record(line) if action == "record" else None
        if record is not None:
            lines[index] = draw(mutated_record(record))
        elif action == "raw":
            lines.insert(index, draw(st.sampled_from(_RAW_LINES) | st.binary(max_size=40)))
        elif action == "cut":
            lines[index] = line[: draw(st.integers(min_value=0, max_value=len(line)))]
        elif action == "copy":
            lines.insert(index, line)
        elif action == "drop" and len(lines) > 1:
            del lines[index]
        elif action == "byte" and line:
            at = draw(st.integers(min_value=0, max_value=len(line) - 1))
            lines[index] = line[:at] + bytes([draw(st.integers(0, 255))]) + line[at + 1 :]
    return b"".join(lines)


def _record(line: bytes) -> dict[str, Any] | None:
    """The line's record, or None where an earlier mutation broke it."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


_RAW_LINES = [
    DEEP.encode() + b"\n",
    b"{" * 50_000 + b"\n",
    b"\n",
    b"null\n",
    b"[]\n",
    b'{"type":"run_started","schema":"2"}\n',
    b'{"type":"plan","request_id":"x"}\n',
    b'{"type":"observation","request_id":"x","tenant":"t","status":' + b"9" * 45 + b"}\n",
    b'{"type":"finding","t_wall":1e999,"kind":"unsafe_accept"}\n',
    b'{"type":"phase","phase":"fill","t_wall":1.0,"from_a_newer_kvcanary":{"x":[1]}}\n',
]

TOML_VALUES = [
    "0", "-1", "1e-300", "1e308", "inf", "nan", "-0.0", "9223372036854775807",
    "9223372036854775808", "100000000000", "true", '""', '"\\u0000"', "[]", "[[]]", "{}",
    '{ a = 1 }', "1979-05-27T07:32:00Z", '"10m"', '"-5s"', '"1e400h"', '"∞"', '"http://"',
    "[" * 5000 + "]" * 5000, '"' + "x" * 5000 + '"',
]  # fmt: skip


@st.composite
def mutated_toml(draw: st.DrawFn, text: str) -> str:
    """A TOML file with values replaced, keys added, lines dropped or doubled, stray text."""
    lines = text.splitlines()
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        index = draw(st.integers(min_value=0, max_value=len(lines) - 1))
        line = lines[index]
        action = draw(st.sampled_from(["value", "value", "key", "drop", "copy", "raw", "cut"]))
        value = draw(st.sampled_from(TOML_VALUES) | st.integers().map(str) | st.text().map(repr))
        if action == "value" and "=" in line:
            lines[index] = f"{line.split('=', 1)[0]}= {value}"
        elif action == "key":
            name = draw(st.sampled_from(["bogus", "tenants", "rate", "sizes", "count"]))
            lines.insert(index, f"{name} = {value}")
        elif action == "drop" and len(lines) > 1:
            del lines[index]
        elif action == "copy":
            lines.insert(index, line)
        elif action == "raw":
            lines.insert(index, draw(st.text(max_size=30)))
        elif action == "cut":
            lines[index] = line[: draw(st.integers(min_value=0, max_value=len(line)))]
    return "\n".join(lines) + "\n"


# -- the CLI's promise -----------------------------------------------------------------------


def exit_status_of(load: Callable[[], object]) -> int:
    """What the CLI would exit with: 0, or 2/3 for the errors it maps; anything else raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            load()
        except ConfigError:
            return EXIT_USAGE
        except RunIncomplete:
            return EXIT_INCOMPLETE
    return EXIT_CLEAN


def _read_everything(run_dir: Path) -> None:
    """What `kvcanary report` reads before it renders: the journal event by event, the fast
    path's scan, and the plan/observation accounting."""
    for _ in read_journal(run_dir):
        pass
    with contextlib.suppress(SlowPathNeeded):
        rare_events(run_dir)
    account_requests(run_dir)


@FUZZ
@given(data=st.data())
def test_the_journal_reader_skips_what_it_cannot_read(
    journal_lines: list[bytes], scratch: Path, data: st.DataObject
) -> None:
    (scratch / JOURNAL_NAME).write_bytes(data.draw(mutated_journal(journal_lines)))
    assert exit_status_of(lambda: _read_everything(scratch)) in (EXIT_CLEAN, EXIT_USAGE)


@settings(FUZZ, max_examples=NUM_REPORT_EXAMPLES)
@given(data=st.data())
def test_kvcanary_report_exits_with_a_status_never_a_traceback(
    journal_lines: list[bytes], scratch: Path, data: st.DataObject
) -> None:
    (scratch / JOURNAL_NAME).write_bytes(data.draw(mutated_journal(journal_lines)))
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        status = main(["report", str(scratch), "--format", "json,md,junit"])
    assert status in (0, 1, 2, 3)
    assert "Traceback" not in err.getvalue() + out.getvalue()
    assert " failed: " not in err.getvalue()  # what could be read, every renderer renders


CONFIG = """\
# kvcanary.toml, as docs/how-to/config-file.md writes it
[run]
target = "http://staging-router:8000"
api-key-env = "STAGING_KEY"
model = "zai-org/GLM-5.3-FP8"
api = "chat"
tenants = 6
concurrency = 16
pool-tokens = 131072
context-tokens = 202752
page-size = 64
requests = 40

[soak]
duration = "8h"
rate = 2.5
report-every = "15m"
rotate-every = "1h"
"""


@FUZZ
@given(data=st.data())
def test_a_broken_config_file_is_one_line_and_exit_2(scratch: Path, data: st.DataObject) -> None:
    path = scratch / "kvcanary.toml"
    path.write_text(data.draw(mutated_toml(CONFIG)), encoding="utf-8", errors="surrogatepass")
    assert exit_status_of(lambda: resolve("run", {}, path)) in (EXIT_CLEAN, EXIT_USAGE)
    assert exit_status_of(lambda: resolve("soak", {}, path)) in (EXIT_CLEAN, EXIT_USAGE)


SCENARIOS = sorted((ROOT / "harness" / "scenarios").glob("*.toml"))


@FUZZ
@given(data=st.data())
def test_a_broken_scenario_file_is_one_line_and_exit_2(scratch: Path, data: st.DataObject) -> None:
    shipped = data.draw(st.sampled_from(SCENARIOS))
    path = scratch / shipped.name
    text = data.draw(mutated_toml(shipped.read_text(encoding="utf-8")))
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    assert exit_status_of(lambda: load_scenario(path)) in (EXIT_CLEAN, EXIT_USAGE)


def test_the_files_mutated_are_real_and_load_as_they_are(
    journal_lines: list[bytes], scratch: Path
) -> None:
    """The starting points load cleanly: a mutation, not the original, is what breaks."""
    (scratch / JOURNAL_NAME).write_bytes(b"".join(journal_lines))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(read_journal(scratch))) == len(journal_lines)
    path = scratch / "kvcanary.toml"
    path.write_text(CONFIG, encoding="utf-8")
    assert resolve("run", {}, path).tenants == 6
    assert len(SCENARIOS) >= 5
    for shipped in SCENARIOS:
        assert load_scenario(shipped).name == shipped.stem

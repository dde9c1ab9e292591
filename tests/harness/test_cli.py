"""The `kvcanary` command's own behaviour: `--version`, and usage errors in one line with a
guess at what was meant and a pointer to the subcommand's `--help` (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

from kvcanary.harness.cli import main


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The stderr of a command line that must be a usage error: exit 2, one line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err.count("\n") == 1, printed.err
    return printed.err.rstrip("\n")


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvcanary {metadata.version('kvcanary')}\n"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["rn"],
            "kvcanary: error: argument COMMAND: invalid choice: 'rn' (did you mean 'run'?); "
            "see kvcanary --help",
        ),
        (
            ["run", "--targt", "http://127.0.0.1:1"],
            "kvcanary run: error: unrecognized arguments: --targt http://127.0.0.1:1 "
            "(did you mean --target?); see kvcanary run --help",
        ),
        (
            ["soak", "--duraton=1h", "--seeed", "4"],
            "kvcanary soak: error: unrecognized arguments: --duraton=1h --seeed 4 "
            "(did you mean --duration / --seed?); see kvcanary soak --help",
        ),
        (
            ["audit", "--targte", "http://127.0.0.1:1"],
            "kvcanary audit: error: unrecognized arguments: --targte http://127.0.0.1:1 "
            "(did you mean --target?); see kvcanary audit --help",
        ),
    ],
)
def test_a_mistyped_command_or_flag_gets_a_suggestion(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert usage_error(argv, capsys) == expected


def test_nothing_close_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["xyzzy"], capsys)
    assert err.startswith(
        "kvcanary: error: argument COMMAND: invalid choice: 'xyzzy' (choose from "
    )
    assert "run, soak, report" in err
    assert "did you mean" not in err
    err = usage_error(["run", "--zzzzzz"], capsys)
    assert err == ("kvcanary run: error: unrecognized arguments: --zzzzzz; see kvcanary run --help")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["run", "--target", "localhost:8000"],
            "kvcanary run: error: argument --target: not an http(s) URL: 'localhost:8000'; "
            "see kvcanary run --help",
        ),
        ([], "kvcanary: error: the following arguments are required: COMMAND; see kvcanary --help"),
        (
            ["repro"],
            "kvcanary repro: error: the following arguments are required: SCENARIO; "
            "see kvcanary repro --help",
        ),
    ],
)
def test_a_bad_value_is_one_line_without_the_usage_block(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(argv, capsys)
    assert err == expected
    assert "usage:" not in err


def test_the_console_script_speaks_the_same() -> None:
    # as a user runs it: `python -m kvcanary`, a fresh process
    done = subprocess.run(
        [sys.executable, "-m", "kvcanary", "run", "--targt", "http://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "kvcanary run: error: unrecognized arguments: --targt http://127.0.0.1:1 "
        "(did you mean --target?); see kvcanary run --help"
    ]

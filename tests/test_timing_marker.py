"""The root conftest's rules, run on a small project: a `timing` test's failure is rerun and
reported, a test that fails every attempt fails the run, and an empty run is a failure."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    # the project's own addopts, so the summary below is the one CI prints
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
        "addopts"
    ]
    pytester.makeini(
        f"[pytest]\naddopts = {addopts}\n"
        "markers =\n    timing: real wall clock\n    soak: the soak\n"
    )
    return pytester


def test_a_timing_test_that_passes_on_a_rerun_passes_and_the_rerun_is_reported(
    project: pytest.Pytester,
) -> None:
    project.makepyfile(
        """
        import pytest
        attempts = []

        @pytest.mark.timing
        def test_races_once():
            attempts.append(1)
            assert len(attempts) > 1, "lost the race on a loaded machine"

        def test_plain_fails_once():
            assert False
        """
    )
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    # an untimed test is never rerun
    assert result.parseoutcomes() == {"passed": 1, "failed": 1, "rerun": 1}
    # and the rerun is named in the summary, so a log says which test lost a race
    result.stdout.fnmatch_lines(["*rerun test summary info*", "RERUN *::test_races_once"])
    reruns = [line for line in result.outlines if line.startswith("RERUN ")]
    assert len(reruns) == 1, reruns


def test_a_timing_test_that_fails_every_attempt_fails_the_run(project: pytest.Pytester) -> None:
    project.makepyfile(
        """
        import pytest

        @pytest.mark.timing
        def test_always_slow():
            assert False
        """
    )
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.parseoutcomes() == {"failed": 1, "rerun": 2}
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_run_that_collects_nothing_fails(project: pytest.Pytester) -> None:
    project.makepyfile("def helper():\n    pass\n")
    result = project.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*no tests ran; that is a failure here*"])

"""Runs `interpreted/` (the Triton kernel's tests) in a child process under Triton's interpreter.

The child gets TRITON_INTERPRET=1 in its environment before it imports anything (see
`interpreted/conftest.py` for why it must be a process of its own); this process never has it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FOLDER = Path(__file__).parent / "interpreted"


@pytest.mark.slow
def test_the_kernel_tests_pass_under_the_interpreter() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install 'kvcanary[gpu]')")
    if os.environ.get("TRITON_INTERPRET"):
        pytest.skip("TRITON_INTERPRET is set: this process collects interpreted/ itself")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-p",
            "no:xdist",
            str(FOLDER),
        ],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\d+ passed", summary), summary
    assert "skipped" not in summary, summary

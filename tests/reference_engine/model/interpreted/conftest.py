"""Tests of the Triton kernel under Triton's CPU interpreter, in a process of their own.

Triton decides interpreted or compiled once per function, when it is decorated: its library's
functions (`tl.max`, `tl.sum`, ...) when triton is imported, the kernel when
`model.triton_attention` is. So these tests run only in a process that had TRITON_INTERPRET=1
in its environment from the start: `../test_kernel_interpreter.py` starts one for them, and
any other process leaves them out of collection (they are run, just not there), so neither the
variable nor interpreted kernels ever reach the other tests.

By hand: TRITON_INTERPRET=1 pytest tests/reference_engine/model/interpreted
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "on", "yes"}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    return None if INTERPRETED else True


@pytest.fixture(scope="session")
def kernel() -> ModuleType:
    """`model.triton_attention`, built for the interpreter."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'kvcanary[gpu]')")
    from kvcanary.reference_engine.model import triton_attention

    assert triton_attention.INTERPRETED
    return triton_attention

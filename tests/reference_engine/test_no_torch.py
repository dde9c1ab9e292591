"""The scheduling side of the engine imports no torch (like nano-vllm's scheduler)."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = [
    "reference_engine.allocator",
    "reference_engine.config",
    "reference_engine.decode_scheduler",
    "reference_engine.finish",
    "reference_engine.interfaces",
    "reference_engine.limits",
    "reference_engine.page_tags",
    "reference_engine.prefill_scheduler",
    "reference_engine.recall_schedule",
    "reference_engine.sequence",
    "reference_engine.transfer",
]


def test_schedulers_allocator_and_transfer_import_no_torch() -> None:
    imports = "; ".join(f"import {name}" for name in TORCH_FREE)
    code = f"import sys; {imports}; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"

"""The scheduling side of the engine imports no torch (like nano-vllm's scheduler)."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = [
    "kvcanary.reference_engine.allocator",
    "kvcanary.reference_engine.config",
    "kvcanary.reference_engine.decode_scheduler",
    "kvcanary.reference_engine.finish",
    "kvcanary.reference_engine.interfaces",
    "kvcanary.reference_engine.limits",
    "kvcanary.reference_engine.page_tags",
    "kvcanary.reference_engine.prefill_scheduler",
    "kvcanary.reference_engine.recall_schedule",
    "kvcanary.reference_engine.sequence",
    "kvcanary.reference_engine.transfer",
]


def test_schedulers_allocator_and_transfer_import_no_torch() -> None:
    imports = "; ".join(f"import {name}" for name in TORCH_FREE)
    code = f"import sys; {imports}; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"

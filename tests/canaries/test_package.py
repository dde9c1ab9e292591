"""The package's public surface and its dependency rules."""

from __future__ import annotations

import subprocess
import sys

from kvcanary import canaries


def test_public_api_is_exported() -> None:
    for name in [
        "Tokenizer", "load_tokenizer", "RemoteTokenizer", "CanaryMinter", "CanaryOrigin",
        "CANARY_PATTERN", "build_prompt", "BuiltPrompt", "CanarySpan", "CanaryIndex",
        "StreamScanner", "Hit", "Owner", "Relation", "classify", "redact", "CanaryError",
    ]:  # fmt: skip
        assert name in canaries.__all__, name
        assert hasattr(canaries, name), name
    assert issubclass(canaries.CanaryError, ValueError)


def test_importing_canaries_pulls_in_no_torch_engine_or_harness() -> None:
    code = (
        "import sys, kvcanary.canaries; "
        "bad = [m for m in ('torch', 'kvcanary.reference_engine', 'kvcanary.harness', "
        "'kvcanary.tenants', 'kvcanary.reports') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

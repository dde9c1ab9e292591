"""The device and dtype an engine config names: one clear error for a CUDA that is not there."""

from __future__ import annotations

import pytest
import torch

from kvcanary.canaries.errors import ConfigError
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.device import kv_dtype, resolve_device
from kvcanary.reference_engine.model_runner import ModelRunner


def test_cuda_without_cuda_is_one_clear_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as raised:
        resolve_device("cuda")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("device 'cuda' requested, but CUDA is not available")
    assert "use device 'cpu'" in message
    with pytest.raises(ConfigError, match="CUDA is not available"):  # before any tensor
        ModelRunner(EngineConfig(device="cuda:0"), 1000, pool_tokens=64)


def test_a_gpu_index_past_the_last_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"'cuda:3' requested, but only 1 GPU\(s\)"):
        resolve_device("cuda:3")


def test_cpu_and_the_pool_dtypes() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert kv_dtype("bfloat16") is torch.bfloat16
    assert kv_dtype("float16") is torch.float16
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        EngineConfig(dtype="int8")


def test_pools_take_the_configured_dtype() -> None:
    runner = ModelRunner(EngineConfig(dtype="bfloat16"), 1000, pool_tokens=64)
    assert {t.dtype for t in runner.k_pool + runner.v_pool} == {torch.bfloat16}
    assert len(runner.read_pages([1])) == runner.model.num_layers * 2 * 16 * 2 * 64 * 2

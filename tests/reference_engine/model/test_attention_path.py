"""Which paged attention a side runs, and the one line that says so, for every situation:
CPU, CUDA with and without triton, a head size the kernel does not take, and each override."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.model.attention import paged_attention
from kvcanary.reference_engine.model.attention_path import ENV_VAR, choose_attention


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if triton were not installed (`find_spec` answers None for a None module entry)."""
    monkeypatch.setitem(sys.modules, "triton", None)


@pytest.fixture
def with_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install 'kvcanary[gpu]')")


def config(**fields: Any) -> EngineConfig:
    return EngineConfig(**fields)


def test_cpu_runs_the_torch_path_and_says_the_kernel_is_for_cuda() -> None:
    path = choose_attention(config())
    assert not path.kernel
    assert (
        path.line == "attention: torch paged path (device cpu; the Triton kernel is used on CUDA)"
    )
    assert path.function() is paged_attention


@pytest.mark.usefixtures("with_triton")
def test_cuda_with_triton_runs_the_kernel() -> None:
    path = choose_attention(config(device="cuda:0", dtype="bfloat16"))
    assert path.kernel
    assert path.line == (
        "attention: Triton paged kernel (cuda:0, bfloat16 KV read through the block table)"
    )


@pytest.mark.usefixtures("without_triton")
def test_cuda_without_triton_says_why_and_how_to_install_it() -> None:
    path = choose_attention(config(device="cuda"))
    assert not path.kernel
    assert "triton is not installed (pip install 'kvcanary[gpu]')" in path.line
    assert path.line.count("\n") == 0


@pytest.mark.usefixtures("with_triton")
def test_a_head_size_past_the_kernel_falls_back_to_torch_and_says_so() -> None:
    path = choose_attention(config(device="cuda", head_dim=320))
    assert not path.kernel
    assert path.line == (
        "attention: torch paged path (the Triton kernel cannot run here: head_dim 320 is over "
        "the kernel's 256)"
    )


@pytest.mark.usefixtures("with_triton")
def test_the_torch_path_can_be_forced_by_config_or_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forced = choose_attention(config(device="cuda", attention="torch"))
    assert forced.line == "attention: torch paged path (attention=torch, the oracle)"
    monkeypatch.setenv(ENV_VAR, "torch")
    from_env = choose_attention(config(device="cuda"))
    assert from_env.line == "attention: torch paged path (KVCANARY_ATTENTION=torch, the oracle)"
    monkeypatch.setenv(ENV_VAR, "triton")  # the config's own choice wins over the variable
    assert not choose_attention(config(device="cuda", attention="torch")).kernel


@pytest.mark.usefixtures("with_triton")
def test_the_kernel_forced_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"attention=triton: .* TRITON_INTERPRET=1"):
        choose_attention(config(attention="triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = choose_attention(config(attention="triton"))
    assert path.kernel
    assert "Triton's CPU interpreter" in path.line


@pytest.mark.usefixtures("without_triton")
def test_the_kernel_forced_without_triton_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match=r"triton is not installed") as error:
        choose_attention(config(device="cuda", attention="triton"))
    assert "\n" not in str(error.value)


def test_a_bad_override_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "cuda-graphs")
    with pytest.raises(ConfigError, match="KVCANARY_ATTENTION must be one of auto, torch, triton"):
        choose_attention(config())
    with pytest.raises(ValueError, match="attention must be one of"):
        config(attention="flash")

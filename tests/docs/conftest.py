"""Fixtures of the docs tests: every page as the built site shows it."""

from __future__ import annotations

import pytest
from docs_pages import pages


@pytest.fixture(scope="session")
def expanded() -> dict[str, str]:
    """Every page as the built site shows it: its generated parts filled in."""
    import docsgen

    return {name: docsgen.expand(text) for name, text in pages().items()}

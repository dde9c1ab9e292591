"""The docs site's pages as the tests read them: `docsgen` (the generators, in docs/) is made
importable as the mkdocs hook imports it, from the docs folder."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
sys.path.insert(0, str(DOCS))

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def pages() -> dict[str, str]:
    """Every Markdown page of the site, by its path under docs/, as written (unexpanded)."""
    return {str(p.relative_to(DOCS)): p.read_text() for p in sorted(DOCS.rglob("*.md"))}


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of `text` in `language`."""
    return [body for lang, body in FENCE.findall(text) if lang == language]

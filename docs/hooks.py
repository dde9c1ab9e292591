"""mkdocs hook: expand every page's `<!-- generate: NAME -->` markers from the code.

Named in `mkdocs.yml` (`hooks:`). The generators are the `docsgen` package next to this
file (see its docstring); a marker naming no generator, or a generator that raises, fails
the build, so `mkdocs build --strict` in `scripts/check` catches it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `docsgen` lives next to this file

import docsgen
from mkdocs.exceptions import PluginError


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """mkdocs event: the page's Markdown with its generated parts filled in."""
    try:
        return docsgen.expand(markdown)
    except docsgen.UnknownGenerator as exc:
        raise PluginError(f"{page.file.src_path}: {exc}") from None

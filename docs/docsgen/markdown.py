"""Markdown building blocks the generators share: tables and inline code, escaped once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(text: object) -> str:
    """A table cell: `|` escaped, line breaks folded, empty shown as a dash."""
    value = " ".join(str(text).split())
    return value.replace("|", "\\|") if value else "—"


def code(text: object) -> str:
    """Inline code for a table cell (`|` escaped as the table needs)."""
    return f"`{text}`".replace("|", "\\|")


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table; cells are taken as already formatted (see `cell`, `code`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"

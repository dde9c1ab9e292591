"""A counterexample trail as a readable sequence of steps.

`spin -t -p` replays pan's trail and prints every statement it executes; the model prints a
line starting with "@<request> " at each step that matters (a request sent, a page allocated,
a write posted and landed, a commit, a read, a drop, a free). `parse_steps` keeps those lines,
in order; `render` numbers them and names the pages' contents, with the violation last.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

_STEP = re.compile(r"^\s*@(\d+) (.+?)\s*$")
_HOLDS = re.compile(r"\(holds KV of (\d+)\)")


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a counterexample: which request's process did what."""

    request: int
    text: str

    @property
    def reads_from(self) -> int | None:
        """For a read: whose KV the page held (None: nobody's, or not a read)."""
        found = _HOLDS.search(self.text)
        return None if found is None or found.group(1) == "0" else int(found.group(1)) - 1

    def describe(self) -> str:
        text = _HOLDS.sub(_holds_text, self.text)
        return f"request {self.request}: {text}"


def _holds_text(found: re.Match[str]) -> str:
    owner = int(found.group(1))
    return "(holds nothing written)" if owner == 0 else f"(holds request {owner - 1}'s KV)"


def parse_steps(replay: str) -> Iterator[Step]:
    """The model's step lines in `spin -t -p` output, in execution order."""
    for line in replay.splitlines():
        found = _STEP.match(line)
        if found:
            yield Step(int(found.group(1)), found.group(2))


def render(steps: Iterable[Step], violation: str | None = None) -> list[str]:
    """Numbered lines, e.g. `3. request 1: decode allocates page 0`; the violation last."""
    lines = [f"{i:>3}. {step.describe()}" for i, step in enumerate(steps, start=1)]
    if violation is not None:
        lines.append(f"     => violated: {violation}")
    return lines

"""The scenarios shipped with kvcanary: `*.toml` files in this package, found by name.

`kvcanary repro NAME` and `kvcanary scenarios` read them through `importlib.resources`, so
they work from a wheel as well as from a source tree. This module only finds and reads the
files; `harness.scenarios.schema` validates them.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

SUFFIX = ".toml"


def _files() -> list[Traversable]:
    return sorted(
        (f for f in resources.files(__name__).iterdir() if f.name.endswith(SUFFIX)),
        key=lambda f: f.name,
    )


def shipped_names() -> tuple[str, ...]:
    """Names of the shipped scenarios (file names without `.toml`), sorted."""
    return tuple(f.name.removesuffix(SUFFIX) for f in _files())


def shipped_file(name: str) -> Traversable | None:
    """The shipped scenario file called `name`, or None."""
    for file in _files():
        if file.name == name + SUFFIX:
            return file
    return None

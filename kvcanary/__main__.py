"""`python -m kvcanary`: the same as the `kvcanary` console script."""

from kvcanary.harness.cli import entry

entry()

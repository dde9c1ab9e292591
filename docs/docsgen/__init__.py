"""The docs site's generated parts: Markdown made from the code at build time, never copied.

A page asks for a generated part with a marker on a line of its own,

    <!-- generate: cli-reference -->

and `expand` replaces the marker with what the named generator returns. `docs/hooks.py` runs
`expand` on every page as mkdocs builds the site, so the reference pages cannot drift from the
option registry, the argparse parsers, the finding vocabulary, the journal's events, the
shipped scenarios or `pyproject.toml`. A marker naming no generator fails the build.

The generators live in this package (one module per source of facts): `cli` (commands and
options), `plugin` (the pytest plugin), `contract` (findings, verdicts, exit codes, the
journal), `project` (extras, scenarios, workload profiles, what a default run sends).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from docsgen import cli, contract, plugin, project

MARKER = re.compile(r"^<!-- generate: ([a-z0-9-]+) -->$", re.MULTILINE)

GENERATORS: dict[str, Callable[[], str]] = {
    "cli-commands": cli.command_list,
    "cli-reference": cli.cli_reference,
    "option-matrix": cli.option_matrix,
    "plugin-options": plugin.plugin_options,
    "suite-checks": plugin.suite_checks,
    "verdict-table": contract.verdict_table,
    "exit-codes": contract.exit_codes,
    "output-files": contract.output_files,
    "summary-keys": contract.summary_keys,
    "remedies": contract.remedies,
    "journal-events": contract.journal_events,
    "error-kinds": contract.error_kinds,
    "extras": project.extras,
    "scenarios": project.scenarios,
    "profiles": project.profiles,
    "default-run": project.default_run,
}


class UnknownGenerator(ValueError):
    """A page's marker names no generator (a typo, or a generator that was removed)."""


def markers(markdown: str) -> list[str]:
    """The generator names a page asks for, in order."""
    return MARKER.findall(markdown)


def expand(markdown: str) -> str:
    """`markdown` with every marker replaced by its generator's Markdown."""

    def generated(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            known = ", ".join(sorted(GENERATORS))
            raise UnknownGenerator(f"<!-- generate: {name} -->: no such generator ({known})")
        return GENERATORS[name]().rstrip("\n")

    return MARKER.sub(generated, markdown)

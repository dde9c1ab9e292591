"""The README is the short front door: it fits on a screen, its two commands are the ones CI
runs, the figures it gives for a default run are the code's, and its links lead somewhere."""

from __future__ import annotations

import re

from docs_pages import README, ROOT, code_blocks
from docsgen.project import default_totals

from kvcanary.harness.run.config import DEFAULT_CONCURRENCY, DEFAULT_NUM_REQUESTS
from kvcanary.harness.run.option_values import format_duration
from kvcanary.harness.run.options import OPTIONS_BY_NAME

MAX_LINES = 250


def readme_prose() -> str:
    """The README with line breaks folded, so a phrase is found wherever it wraps."""
    return " ".join(README.read_text().split())


def ci_command() -> str:
    """The command `.ci/run` runs: its last line."""
    return (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]


def test_the_readme_fits_on_a_screen() -> None:
    assert len(README.read_text().splitlines()) <= MAX_LINES


def test_its_two_commands_are_the_ones_ci_runs() -> None:
    first, second = code_blocks(README.read_text(), "bash")[:2]
    assert second.strip() == ci_command()
    # the main job: CI's venv and pip install with the engine extra, then `kvcanary run`
    steps = ci_command().split(" && ")
    venv = next(step for step in steps if step.startswith("python3 -m venv"))
    install = next(step for step in steps if " install " in step).replace("[dev]", "[engine]")
    assert first.strip() == f"{venv} && {install} && .venv/bin/kvcanary run"


def test_the_default_run_it_describes_is_the_code_s() -> None:
    prose = readme_prose()
    totals = default_totals(131_072)
    timeout = OPTIONS_BY_NAME["timeout"].default
    rounds = -(-DEFAULT_NUM_REQUESTS // DEFAULT_CONCURRENCY)
    assert (
        f"{DEFAULT_NUM_REQUESTS} requests from {OPTIONS_BY_NAME['tenants'].default} tenants"
        in prose
    )
    assert f"{DEFAULT_CONCURRENCY} in flight" in prose
    assert f"{totals.num_prompt_tokens / 131_072:.0f} × the context length" in prose
    assert f"{totals.num_prompt_tokens / 1e6:.1f} M at a 128k context" in prose
    assert f"{totals.num_completion_tokens:,} completion tokens" in prose
    assert f"`--timeout` ({format_duration(timeout)})" in prose
    assert f"within {round(rounds * timeout / 60)} minutes" in prose
    assert f"(`--tokenizer {OPTIONS_BY_NAME['tokenizer'].default}`)" in prose


def test_its_links_lead_to_pages_that_exist() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing


def test_the_development_page_shows_the_same_command() -> None:
    assert f"```bash\n{ci_command()}\n```" in (ROOT / "docs" / "development.md").read_text()

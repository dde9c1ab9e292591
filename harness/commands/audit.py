"""`kvcanary audit`: does each side's KV pool hold the context the deployment advertises?

Prints one table row per side (pool tokens, context tokens, ratio, verdict), where each
figure came from (read from the target, and from which endpoint, or given with
`--pool-tokens` / `--context-tokens` for what the target does not report), the findings,
and, for any side whose pool could not be read, every request that was tried. `--json`
prints the same as one JSON object instead. Credentials are read from the environment
variable named by `--api-key-env` and never printed.

Exit status: 0 every side's pool holds the context (and the probe, if asked for, was
refused); 1 findings; 2 usage error; 3 inconclusive: the target was unreachable or a pool
could not be read. "Unknown" is not "clean", so an audit that could not see a pool never
exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.run.option_flags import add_to_parser, given_values
from kvcanary.harness.run.options import options_for

if TYPE_CHECKING:
    from rich.table import Table

    from kvcanary.harness.target.audit import AuditResult


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="check that each side's KV pool can hold the advertised context",
        description=(
            "Read the KV pool size and context length each serving side reports (SGLang "
            "/get_server_info, vLLM /metrics and /v1/models, llama.cpp /props, /slots and "
            "/v1/models) and flag every side whose pool is smaller than the context clients "
            "are told they may send. --pool-tokens/--context-tokens supply figures the target "
            "does not report. With --probe, confirm by sending one prompt just above the "
            "smallest pool and checking it is refused."
        ),
        epilog=(
            "Exit status: 0 clean, 1 findings, 2 usage error, 3 inconclusive (target "
            "unreachable or a pool size unknown: unknown is not clean)."
        ),
    )
    # values are checked by the handler: a bad one is one line and exit 2, like every other
    # usage error of the audit
    add_to_parser(parser, options_for("audit"), parse_now=False)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from kvcanary.harness.run.config import Layer, settings
    from kvcanary.harness.target.audit import run_audit
    from kvcanary.harness.target.urls import server_root

    given = given_values(args, options_for("audit"), parse=True)
    options = settings("audit", Layer("the command line", given))
    if not (options["target"] or options["prefill"] or options["decode"]):
        raise ConfigError("audit needs --target URL (or --prefill URL / --decode URL)")
    target = options["target"]
    if target is not None:  # `.../v1` as OpenAI clients take it: the server's root
        target = server_root(target, lambda line: print(line, file=sys.stderr))
    headers = _auth_headers(options["api_key_env"])
    seconds: float = options["timeout"]

    async def audit() -> AuditResult:
        timeout = httpx.Timeout(seconds, connect=min(seconds, 10.0))
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await run_audit(
                client,
                target=target,
                prefill_urls=options["prefill"],
                decode_urls=options["decode"],
                probe=options["probe"],
                model=options["model"],
                headers=headers,
                pool_tokens=options["pool_tokens"],
                context_tokens=options["context_tokens"],
            )

    result = asyncio.run(audit())
    if options["json"]:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        _print_result(result)
    return result.exit_status


def _auth_headers(variable: str | None) -> dict[str, str]:
    if variable is None:
        return {}
    key = os.environ.get(variable)
    if not key:
        raise ConfigError(f"--api-key-env {variable}: that environment variable is not set")
    return {"Authorization": f"Bearer {key}"}


def _print_result(result: AuditResult) -> None:
    from rich.console import Console

    from kvcanary.harness.record.verdict import Verdict
    from kvcanary.harness.target.urls import redact_url

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 160  # logs and pipes: room for a full row rather than 80 columns

    def say(text: str) -> None:
        console.print(text, soft_wrap=True)

    facts = result.facts
    model = f"  model {facts.model}" if facts.model else ""
    say(f"target {redact_url(facts.base_url)}  engine {facts.engine}{model}")
    if result.sides:
        console.print(_sides_table(result))
    if result.figures:
        say("figures:")
    for figure in result.figures:
        console.print(f"  {figure.describe()}", markup=False, soft_wrap=True)
    for number, line in enumerate(_unknown_lines(result)):
        console.print(line, style="yellow" if number == 0 else None, markup=False, soft_wrap=True)
    if result.probe is not None:
        probe = result.probe
        said = [f"{probe.num_tokens} tokens, {probe.token_count}" if probe.num_tokens else ""]
        said += [f"HTTP {probe.status}" if probe.status is not None else "", probe.error or ""]
        say(f"probe {probe.url}: {probe.outcome} ({'; '.join(filter(None, said))})")
    for finding in result.findings:
        say(f"[bold red]{finding.kind}[/] ({finding.severity}): {finding.summary}")
    num_findings = len(result.findings)
    style = {Verdict.CLEAN: "green", Verdict.UNSAFE: "bold red"}.get(result.verdict, "yellow")
    say(
        f"verdict: [{style}]{result.verdict}[/] "
        f"({num_findings} finding{'' if num_findings == 1 else 's'})"
    )


def _sides_table(result: AuditResult) -> Table:
    """One row per side: its pool, context, their ratio and the verdict, coloured."""
    from rich.table import Table

    from kvcanary.harness.target.audit import SideVerdict
    from kvcanary.harness.target.urls import redact_url

    table = Table("side", "url", "pool tokens", "context tokens", "ratio", "verdict")
    table.columns[1].overflow = "fold"
    table.columns[5].no_wrap = True
    styles = {SideVerdict.OK: "green", SideVerdict.UNKNOWN: "yellow"}
    for side in result.sides:
        table.add_row(
            side.side.role,
            redact_url(side.side.url),
            _figure(side.side.pool_tokens),
            _figure(side.side.context_tokens),
            "-" if side.ratio is None else f"{side.ratio:.3f}",
            f"[{styles.get(side.verdict, 'bold red')}]{side.verdict}[/]",
        )
    return table


def _unknown_lines(result: AuditResult) -> list[str]:
    """Where a pool could not be read: which side, and every request that was tried."""
    from kvcanary.harness.target.audit import SideVerdict
    from kvcanary.harness.target.urls import redact_url

    unknown = [s for s in result.sides if s.verdict is SideVerdict.UNKNOWN]
    if result.sides and not unknown:
        return []
    what = "; ".join(f"{s.side.role} {redact_url(s.side.url)}: {s.reason}" for s in unknown)
    lines = [
        "could not read the pool size"
        + (f" ({what})" if what else " of any side")
        + "; here is what was tried:"
    ]
    lines += [f"  {redact_url(attempt.describe())}" for attempt in result.facts.attempts]
    return [*lines, "pass the sides' URLs with --prefill/--decode if a router hides them"]


def _figure(value: int | None) -> str:
    return "unknown" if value is None else f"{value:,}"

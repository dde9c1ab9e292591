"""`kvcanary report RUN_DIR`: re-render a run's reports from its journal.

Top-level imports stay light (argparse only) so `kvcanary --help` is instant; pandas and
matplotlib load inside the handler. Exit status follows the verdict: 0 clean, 1 leak,
3 inconclusive; 2 for bad usage (no such directory, no journal, an unknown format).
A report that could not be fully written also exits non-zero (3 unless the verdict is leak),
and so does a journal whose plans and observations do not pair up (`reports.accounting`).
It ends with the same verdict block as `kvcanary run` (`reports.verdict_block`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EXIT_RENDER_FAILED = 3


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="re-render a run's reports (HTML, Markdown, JUnit, JSON) from its journal",
        description=(
            "Re-render summary.json, evidence/, report.md, junit.xml and report.html of a run "
            "from its journal. Reports are a pure function of the journal, so an interrupted "
            "or crashed run can be reported too."
        ),
        epilog="Exit status: 0 clean, 1 leak (findings), 2 usage error, 3 inconclusive.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run's --out directory")
    parser.add_argument(
        "--format",
        default="html,md,junit,json",
        metavar="FORMATS",
        help="comma-separated outputs to write: html, md, junit, json (json includes "
        "evidence/); default: all",
    )
    parser.add_argument(
        "--keep-raw-evidence",
        action="store_true",
        help="put full response text into evidence/ files (mode 0600) where the journal has "
        "it; that text may be another customer's data",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the reports here instead of RUN_DIR",
    )
    parser.set_defaults(handler=run_report)


def run_report(args: argparse.Namespace) -> int:
    from kvcanary.reports.render import parse_formats, render_run

    result = render_run(
        args.run_dir,
        formats=parse_formats(args.format),
        keep_raw_evidence=args.keep_raw_evidence,
        out_dir=args.out,
    )
    from kvcanary.reports.verdict_block import verdict_block

    for name, reason in result.errors.items():
        print(f"kvcanary: report: {name} failed: {reason}", file=sys.stderr)
    summary = result.summary
    print(
        verdict_block(
            str(result.verdict),
            summary["verdict_reasons"],
            summary["finished"]["reason"],
            {**result.paths, **_journal(args.run_dir)},
        )
    )
    status = result.verdict.exit_status
    if not _accounted(args.run_dir) and status == 0:
        return EXIT_RENDER_FAILED
    if result.errors and status == 0:
        return EXIT_RENDER_FAILED
    return status


def _accounted(run_dir: Path) -> bool:
    """Check that every plan has exactly one observation (but those a crash lost); say what
    a crash lost or tore, and any violation (a defect of kvcanary itself)."""
    from kvcanary.reports.accounting import account_requests

    accounting = account_requests(run_dir)
    if accounting.lost_to_crash or accounting.num_torn_lines:
        print(accounting.describe())
    for problem in accounting.problems():
        print(f"kvcanary: report: journal check: {problem}", file=sys.stderr)
    return accounting.consistent


def _journal(run_dir: Path) -> dict[str, Path]:
    from kvcanary.harness.record.journal import journal_segments

    segments = journal_segments(run_dir)
    return {"journal": segments[-1]} if segments else {}

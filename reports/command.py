"""`kvcanary report RUN_DIR`: re-render a run's reports from its journal.

Top-level imports stay light (argparse and the output contract's names) so `kvcanary --help`
is instant; pandas and matplotlib load inside the handler. Exit status follows the verdict
(`harness.record.verdict`): 0 clean, 1 leak or unsafe, 3 inconclusive; 2 for bad usage (no
such directory, no journal, an unknown format). A clean run whose reports could not all be
written exits 3, and so does one whose plans and observations do not pair up
(`reports.accounting`).
It ends with the same verdict block as `kvcanary run` (`reports.verdict_block`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcanary.harness.record.outputs import (
    EVIDENCE_DIR,
    HTML_NAME,
    JUNIT_NAME,
    MARKDOWN_NAME,
    SUMMARY_NAME,
)
from kvcanary.harness.record.verdict import exit_status

if TYPE_CHECKING:
    from kvcanary.reports.accounting import Accounting


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="re-render a run's reports (HTML, Markdown, JUnit, JSON) from its journal",
        description=(
            f"Re-render {SUMMARY_NAME}, {EVIDENCE_DIR}/, {MARKDOWN_NAME}, {JUNIT_NAME} and "
            f"{HTML_NAME} of a run "
            "from its journal. Reports are a pure function of the journal, so an interrupted "
            "or crashed run can be reported too."
        ),
        epilog=(
            "Exit status: 0 clean, 1 leak or unsafe (findings), 2 usage error, 3 inconclusive "
            "(or a clean run whose reports could not all be written)."
        ),
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


MAX_WARNINGS_SHOWN = 20
"""Journal warnings said one per line; past this many, only how many more there were."""


def run_report(args: argparse.Namespace) -> int:
    from kvcanary.reports.render import parse_formats, render_run

    with _journal_warnings_as_lines():
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
    complete = _accounted(args.run_dir, result.accounting) and not result.errors
    return exit_status(result.verdict, reports_complete=complete)


@contextlib.contextmanager
def _journal_warnings_as_lines() -> Iterator[None]:
    """What the journal reader skipped, one line each (each said once, however many times
    the journal is read), at most `MAX_WARNINGS_SHOWN`, then how many more."""
    from kvcanary.harness.record.journal import JournalWarning

    said: set[str] = set()
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], *rest: Any, **named: Any) -> None:
        if not issubclass(category, JournalWarning):
            shown(message, category, *rest, **named)
        elif str(message) not in said:
            said.add(str(message))
            if len(said) <= MAX_WARNINGS_SHOWN:
                print(f"kvcanary: report: warning: {message}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always", JournalWarning)
        warnings.showwarning = show
        yield
    if len(said) > MAX_WARNINGS_SHOWN:
        print(
            f"kvcanary: report: {len(said) - MAX_WARNINGS_SHOWN} more journal warning(s) not shown",
            file=sys.stderr,
        )


def _accounted(run_dir: Path, known: Accounting | None) -> bool:
    """Check that every plan has exactly one observation (but those a crash lost); say what
    a crash lost or tore, and any violation (a defect of kvcanary itself). The render's own
    pass found it where it could (`known`); else the journal's lines are read again."""
    from kvcanary.reports.accounting import account_requests

    accounting = known if known is not None else account_requests(run_dir)
    if accounting.lost_to_crash or accounting.num_torn_lines:
        print(accounting.describe())
    for problem in accounting.problems():
        print(f"kvcanary: report: journal check: {problem}", file=sys.stderr)
    return accounting.consistent


def _journal(run_dir: Path) -> dict[str, Path]:
    from kvcanary.harness.record.journal import journal_segments
    from kvcanary.reports.verdict_block import JOURNAL_OUTPUT

    segments = journal_segments(run_dir)
    return {JOURNAL_OUTPUT: segments[-1]} if segments else {}

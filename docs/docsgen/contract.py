"""The output contract's reference: finding kinds, verdicts, exit codes and the journal.

The verdict table, exit statuses, output files, `summary.json`'s keys, event types and their
fields are read from `kvcanary.harness.record` (the contract every side imports). The
`error_kind` values are the code's; their one-line meanings are kept here, keyed by those
values, and `tests/docs` fails when one is missing or names a kind the code no longer has.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import typing

from docsgen.markdown import cell, code, table
from kvcanary.canaries.span import CanarySpan
from kvcanary.harness.record import events, outputs
from kvcanary.harness.record.finding import Finding
from kvcanary.harness.record.judgement import verdict_table_markdown
from kvcanary.harness.record.observation import ErrorKind, Observation, Usage
from kvcanary.harness.record.outputs import (
    EVIDENCE_DIR,
    JOURNAL_NAME,
    REPORT_FILES,
    Summary,
)
from kvcanary.harness.record.verdict import EXIT_INCOMPLETE, EXIT_USAGE, Reproduction, Verdict
from kvcanary.tenants.plan import RequestPlan

ERROR_KIND_MEANINGS: dict[str, str] = {
    "connect": "refused the connection, DNS failure, connect timeout",
    "timeout": "no byte within the read timeout, or the whole request past its deadline",
    "http_status": "a non-2xx status (its body, bounded, is kept in `error`)",
    "error_in_success": 'an error instead of an answer after HTTP 2xx: an `{"error": ...}` '
    'object, vLLM\'s `{"object": "error", ...}`, or an SSE `event: error` (the text before '
    "it is kept; the protocol detector reports `error_in_success`)",
    "protocol": "malformed SSE/JSON, JSON nested deeper than 64 levels, a non-SSE/JSON body, a "
    "content-encoding other than gzip/deflate that cannot be undone, a `usage` count that is "
    "not an integer from 0 to 10¹² (the text before it is kept)",
    "truncated": "the stream ended (or the connection broke) without `[DONE]` or a `finish_reason`",
    "too_large": "the response passed `max_response_bytes` (default 4 MiB) of *decoded* bytes; "
    "the rest is dropped",
    "disconnected": "the harness dropped the stream on purpose (abort plans)",
    "cancelled": "(not the target) interrupted by Ctrl-C before the response finished",
    "worker_lost": "(not the target) the Ray actor sending it died (`--ray`)",
}


def verdict_table() -> str:
    """The verdict table and every finding kind's row, as `harness.record.judgement` renders
    them (the same table `--help` prints)."""
    return verdict_table_markdown()


def exit_codes() -> str:
    """Exit statuses of every command, from the one exit-status map."""
    by_status: dict[int, list[str]] = {}
    for verdict in Verdict:
        by_status.setdefault(verdict.exit_status, []).append(f"verdict {code(verdict)}")
    for reproduction in Reproduction:
        by_status.setdefault(reproduction.exit_status, []).append(f"`repro`: {code(reproduction)}")
    by_status.setdefault(EXIT_USAGE, []).append("a usage or configuration error (no verdict)")
    by_status[EXIT_INCOMPLETE].append(
        "the run could not complete, or a clean run's reports could not all be written"
    )
    rows = [(str(status), "; ".join(by_status[status])) for status in sorted(by_status)]
    return table(("exit", "meaning"), rows)


def summary_keys() -> str:
    """`summary.json`'s top-level keys, their types and what they hold (`Summary`)."""
    about = attribute_docs(Summary)
    rows = [
        (code(name), code(_type_name(typ)), cell(about.get(name, "")))
        for name, typ in Summary.__annotations__.items()
    ]
    return table(("key", "type", "meaning"), rows)


def _type_name(typ: object) -> str:
    """An annotation as written (`from __future__ import annotations` keeps them as text)."""
    if isinstance(typ, str):
        return typ
    return str(getattr(typ, "__forward_arg__", None) or getattr(typ, "__name__", typ))


def output_files() -> str:
    """The files of a run directory, as `harness.record.outputs` names and describes them."""
    names = {JOURNAL_NAME, EVIDENCE_DIR, *REPORT_FILES.values()}
    rows = []
    for line in (outputs.__doc__ or "").splitlines():
        path, _, about = line.strip().removeprefix("RUN/").partition(" ")
        if path.rstrip("/") in names:
            rows.append((code(path), cell(about)))
    assert len(rows) == len(names), "harness.record.outputs' docstring describes every file"
    return table(("file", "what it holds"), rows)


def error_kinds() -> str:
    """The `error_kind` values an observation can carry."""
    rows = [(code(kind), cell(ERROR_KIND_MEANINGS[kind])) for kind in typing.get_args(ErrorKind)]
    return table(("`error_kind`", "what happened"), rows)


def journal_events() -> str:
    """One section per journal record type: its fields, their types and what they hold."""
    sections = []
    for cls, kind in events.RECORD_TYPES.items():
        doc = " ".join((inspect.getdoc(cls) or "").split())
        rows = [(code(name), code(typ), cell(about)) for name, typ, about in record_fields(cls)]
        sections.append(f"### `{kind}`\n\n{doc}\n\n" + table(("field", "type", "meaning"), rows))
    return "\n".join(sections)


def record_fields(cls: type) -> list[tuple[str, str, str]]:
    """The fields of one record type as `to_record` writes them (plans without their prompt;
    plans, observations and findings flattened into the record)."""
    inner = {
        events.PlanRecorded: RequestPlan,
        events.ObservationRecorded: Observation,
        events.FindingRecorded: Finding,
    }.get(cls)
    if inner is None:
        return _fields(cls)
    own = [f for f in _fields(cls) if f[0] not in {"plan", "observation", "finding"}]
    return own + [f for f in _fields(inner) if f[0] != "prompt"]


def _fields(cls: type) -> list[tuple[str, str, str]]:
    about = attribute_docs(cls)
    rows = []
    for field in dataclasses.fields(cls):
        text = about.get(field.name, "")
        for nested in (events.Limits, Usage, CanarySpan):
            if re.search(rf"\b{nested.__name__}\b", str(field.type)):
                names = ", ".join(f.name for f in dataclasses.fields(nested))
                text = f"{text} A `{nested.__name__}` object: {names}.".strip()
        rows.append((field.name, str(field.type), text))
    return rows


def attribute_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass (its attribute docstring)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    definition = tree.body[0]
    body: list[ast.stmt] = definition.body if isinstance(definition, ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def remedies() -> str:
    """What to do about each finding kind, as the reports' "What to do" section says it
    (`kvcanary.reports.remedies.REMEDIES`)."""
    from kvcanary.reports.remedies import REMEDIES

    sections = []
    for kind, advice in REMEDIES.items():
        lines = [f"### `{kind}`\n", f"{advice.problem}\n"]
        for remedy in advice.remedies:
            links = ", ".join(f"[{ref.label}]({ref.url})" for ref in remedy.references)
            lines.append(f"- {remedy.action}" + (f" ({links})" if links else ""))
        if advice.note:
            lines.append(f"\n{advice.note}")
        sections.append("\n".join(lines) + "\n")
    return "\n".join(sections)

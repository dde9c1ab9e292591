"""A soak's periodic work beside the runner: re-render the report, rotate the journal,
print a heartbeat line off a terminal, and with `--metrics-port` serve Prometheus metrics
fed from the journal's events (`harness.run.metrics`).

A soak that stops before its final render (a full disk, an interrupt, an error) would leave
its last periodic report in place, looking current beside a journal that went on further:
`set_aside_stale_reports` renames such files to `NAME.stale` (a rename, which a full disk
still allows) and says how to render current ones."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path
from typing import Protocol

from kvcanary.harness.record.events import Event
from kvcanary.harness.record.journal import JournalWriter
from kvcanary.harness.record.outputs import HTML_NAME, JOURNAL_NAME, REPORT_FILES, STALE_SUFFIX
from kvcanary.harness.run.config import RunConfig
from kvcanary.harness.run.journal_upkeep import JournalUpkeep
from kvcanary.harness.run.options import format_duration
from kvcanary.harness.run.progress import ProgressDisplay
from kvcanary.harness.run.rendering import render_apart


class SoakJournal(Protocol):
    """The run's journal as a soak needs it (`harness.run.run_journal.Journal`)."""

    @property
    def writer(self) -> JournalWriter: ...

    def listen(self, listener: Callable[[Event], None]) -> None: ...


@contextlib.asynccontextmanager
async def soak_tasks(
    config: RunConfig, out_dir: Path, journal: SoakJournal, display: ProgressDisplay
) -> AsyncIterator[None]:
    """For soaks: re-render the report every `report_every`, rotate every `rotate_every`,
    a heartbeat every `display.interval_s`; metrics on `metrics_port`, when given."""
    if config.command != "soak":
        yield
        return
    async with contextlib.AsyncExitStack() as stack:
        if config.metrics_port is not None:
            from kvcanary.harness.run.metrics import serve_metrics

            metrics = stack.enter_context(serve_metrics(config.metrics_port))
            journal.listen(metrics.handle)
            display.note(f"metrics: http://127.0.0.1:{config.metrics_port}/metrics")
        upkeep = JournalUpkeep(out_dir, config.keep_journal)  # checkpoint, gzip, retention
        journal.listen(upkeep.feed)
        await stack.enter_async_context(_periodic(config, out_dir, journal.writer, upkeep, display))
        yield


@contextlib.asynccontextmanager
async def _periodic(
    config: RunConfig,
    out_dir: Path,
    journal: JournalWriter,
    upkeep: JournalUpkeep,
    display: ProgressDisplay,
) -> AsyncIterator[None]:
    async def report() -> None:
        rendered = await render_apart(out_dir, keep_raw_evidence=config.keep_raw_evidence)
        display.note(
            f"report updated ({display.status_line()}): verdict so far {rendered.verdict}, "
            f"{out_dir / HTML_NAME}"
        )

    async def rotate() -> None:
        closed = journal.rotate()
        display.note(f"journal segment closed: {closed}")
        for deleted in await upkeep.closed(closed):
            display.note(f"journal segment deleted (--keep-journal): {deleted.name}")

    async def heartbeat() -> None:
        display.heartbeat()

    tasks = [
        asyncio.create_task(every(config.report_every, report, display)),
        asyncio.create_task(every(config.rotate_every, rotate, display)),
        asyncio.create_task(every(display.interval_s, heartbeat, display)),
    ]
    display.note(
        f"soak: report every {format_duration(config.report_every)}, new journal segment "
        f"every {format_duration(config.rotate_every)}"
    )
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def set_aside_stale_reports(
    out_dir: Path, display: ProgressDisplay, formats: Collection[str] | None = None
) -> None:
    """Rename a soak's report files (those of `formats`, default all) that are older than
    its journal to `NAME.stale`: the soak went on after they were written, and its final
    render did not replace them."""
    try:
        journaled = (out_dir / JOURNAL_NAME).stat().st_mtime_ns
    except OSError:
        return  # no journal: nothing went on after any report
    moved = []
    for report_format, name in REPORT_FILES.items():
        if formats is not None and str(report_format) not in formats:
            continue
        path = out_dir / name
        try:
            if path.is_file() and path.stat().st_mtime_ns < journaled:
                path.replace(path.with_name(name + STALE_SUFFIX))
                moved.append(name)
        except OSError as exc:
            display.note(f"could not set aside the out-of-date {path}: {exc.strerror or exc}")
    if moved:
        display.note(
            f"the soak's last periodic report is out of date (its final render did not "
            f"replace it): set aside as {', '.join(n + STALE_SUFFIX for n in moved)}; run "
            f"`kvcanary report {out_dir}` for current ones"
        )


async def every(
    period_s: float, action: Callable[[], Awaitable[None]], display: ProgressDisplay
) -> None:
    """Run `action` every `period_s` until cancelled.

    An action already started when the soak ends is finished, not abandoned: a report
    render cut off halfway would leave a stale report.html that says it is current.
    """
    while True:
        await asyncio.sleep(period_s)
        task = asyncio.ensure_future(action())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            await _settle(task, display)
            raise
        except Exception as exc:  # a failed periodic report must not end an 8-hour soak
            display.note(f"periodic task failed: {type(exc).__name__}: {exc}")


async def _settle(task: asyncio.Future[None], display: ProgressDisplay) -> None:
    try:
        await task
    except Exception as exc:
        display.note(f"periodic task failed: {type(exc).__name__}: {exc}")

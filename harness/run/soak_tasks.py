"""A soak's periodic work beside the runner: re-render the report, rotate the journal,
print a heartbeat line off a terminal, and with `--metrics-port` serve Prometheus metrics
fed from the journal's events (`harness.run.metrics`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Protocol

from kvcanary.harness.record.events import Event
from kvcanary.harness.record.journal import JournalWriter
from kvcanary.harness.run.config import RunConfig
from kvcanary.harness.run.options import format_duration
from kvcanary.harness.run.progress import ProgressDisplay


class SoakJournal(Protocol):
    """The run's journal as a soak needs it (`harness.run.wiring.Journal`)."""

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
        await stack.enter_async_context(_periodic(config, out_dir, journal.writer, display))
        yield


@contextlib.asynccontextmanager
async def _periodic(
    config: RunConfig, out_dir: Path, journal: JournalWriter, display: ProgressDisplay
) -> AsyncIterator[None]:

    async def report() -> None:
        from kvcanary.reports.render import render_run

        result = await asyncio.to_thread(
            render_run, out_dir, keep_raw_evidence=config.keep_raw_evidence
        )
        display.note(
            f"report updated ({display.status_line()}): verdict so far {result.verdict}, "
            f"{out_dir / 'report.html'}"
        )

    async def rotate() -> None:
        display.note(f"journal segment closed: {journal.rotate()}")

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

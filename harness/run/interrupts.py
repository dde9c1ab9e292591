"""Ctrl-C during a run: the first stops sending and lets requests in flight finish, the
second cancels them. SIGTERM (a CI job's timeout, `kill`) is a first Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Protocol

from harness.run.progress import ProgressDisplay


class Stoppable(Protocol):
    """What Ctrl-C stops: the runner, or the cache probe."""

    @property
    def stopping(self) -> bool: ...

    def stop(self) -> None: ...

    def cancel(self) -> None: ...


@contextlib.contextmanager
def interrupts(runner: Stoppable, display: ProgressDisplay) -> Iterator[None]:
    """First Ctrl-C: stop sending, let requests in flight finish. Second: cancel them."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread; the caller handles cancellation
        return
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        if not runner.stopping:
            display.note(
                "interrupted: no new requests; finishing those in flight "
                "(Ctrl-C again to cancel them)"
            )
            runner.stop()
        else:
            display.note("cancelling requests in flight")
            runner.cancel()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    loop.add_signal_handler(signal.SIGINT, on_sigint)
    loop.add_signal_handler(signal.SIGTERM, runner.stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)  # which resets to the default: put ours back
            signal.signal(sig, handler)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a CI job's timeout, `kill`) raises KeyboardInterrupt in the main thread for
    the duration of the block, so what was journaled is still reported or the way to report
    it is printed. Inside a run, `interrupts` takes over (SIGTERM is a first Ctrl-C)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

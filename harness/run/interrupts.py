"""Ctrl-C during a run: the first stops sending and lets requests in flight finish, the
second cancels them. SIGTERM (a CI job's timeout, `kill`) is a first Ctrl-C.

Three layers, innermost first: `interrupts` while a runner or the cache probe sends (a
graceful stop); `cancel_on_signal` around a run's whole coroutine (the task is cancelled
where it awaits: a KeyboardInterrupt raised inside whichever task happens to run would end
that task with an exception nobody retrieves, printed as "Task exception was never
retrieved" at exit); `sigterm_as_interrupt` outside the event loop (KeyboardInterrupt).
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Protocol

from kvcanary.harness.run.progress import ProgressDisplay

_REDELIVERY_DELAY_S = 0.05


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


class Interrupted(Exception):
    """The run's coroutine was cancelled by Ctrl-C or SIGTERM (`cancel_on_signal`)."""


@contextlib.contextmanager
def cancel_on_signal() -> Iterator[None]:
    """Inside a run's main coroutine: Ctrl-C or SIGTERM cancels it where it awaits (its
    cleanup runs), and it ends with `Interrupted` (an ordinary exception, which
    `asyncio.run` hands to its caller). `interrupts` takes over inside."""
    task = asyncio.current_task()
    if threading.current_thread() is not threading.main_thread() or task is None:
        yield
        return
    loop = asyncio.get_running_loop()
    fired = False

    def cancel(signum: int, frame: object) -> None:
        nonlocal fired
        fired = True
        with contextlib.suppress(RuntimeError):  # the loop already closed
            loop.call_soon_threadsafe(task.cancel)

    previous = {sig: signal.signal(sig, cancel) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except asyncio.CancelledError:
        if not fired:
            raise
        raise Interrupted from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Delivery:
    """Whether a signal reached `sigterm_as_interrupt`'s block. An interrupt that lands in a
    C extension's module init comes out as an ImportError ("PyCapsule_Import could not
    import module"): the caller asks `fired` to tell it from a broken install."""

    def __init__(self) -> None:
        self.fired = False


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[Delivery]:
    """SIGTERM (a CI job's timeout, `kill`) raises KeyboardInterrupt in the main thread for
    the duration of the block, so what was journaled is still reported or the way to report
    it is printed; SIGINT does the same, through the same handler, so either is recorded in
    the yielded `Delivery`. Inside a run, `interrupts` takes over (SIGTERM is a first Ctrl-C).

    A signal that lands in a finaliser or a weakref callback raises there, where Python
    drops the exception ("Exception ignored in ..."): the SIGTERM would be lost and a
    traceback printed. Such a drop is caught by the unraisable hook and the signal delivered
    again, from another thread, so it is raised in the main thread's own code (if it lands
    in a callback again, it is delivered again)."""
    delivery = Delivery()
    if threading.current_thread() is not threading.main_thread():
        yield delivery
        return

    def interrupt(signum: int, frame: object) -> None:
        delivery.fired = True
        raise KeyboardInterrupt

    previous_hook = sys.unraisablehook

    def redeliver_dropped(unraisable: sys.UnraisableHookArgs) -> None:
        if _raised_by(unraisable.exc_traceback, interrupt):
            _thread.start_new_thread(_interrupt_main_soon, ())
            return
        previous_hook(unraisable)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    sys.unraisablehook = redeliver_dropped
    try:
        yield delivery
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = previous_hook


def _interrupt_main_soon() -> None:
    """Deliver SIGTERM again once the hook that dropped it has returned (a thread that is
    not waited for: the hook must return before the signal is raised, or it is dropped
    again)."""
    time.sleep(_REDELIVERY_DELAY_S)
    _thread.interrupt_main(signal.SIGTERM)


def _raised_by(traceback: TracebackType | None, handler: Callable[..., object]) -> bool:
    """Whether the exception of `traceback` was raised by `handler` itself."""
    last = traceback
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    return last is not None and last.tb_frame.f_code is handler.__code__

"""SIGTERM as a first Ctrl-C, even when it lands where Python drops exceptions."""

from __future__ import annotations

import gc
import os
import signal
import time
import weakref

import pytest

from harness.run.interrupts import sigterm_as_interrupt


class _Target:
    """An object whose weakref callback is where the signal lands."""


def _wait_for_interrupt(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


def _terminate_self() -> None:
    with sigterm_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        _wait_for_interrupt(10)


def _terminate_in_a_weakref_callback() -> None:
    target = _Target()
    ref = weakref.ref(target, lambda _: signal.raise_signal(signal.SIGTERM))
    with sigterm_as_interrupt():
        del target
        gc.collect()
        assert ref() is None  # the callback ran, and the signal was raised inside it
        _wait_for_interrupt(10)


def test_sigterm_raises_keyboard_interrupt_in_the_block() -> None:
    with pytest.raises(KeyboardInterrupt):
        _terminate_self()


def test_a_sigterm_that_lands_in_a_weakref_callback_is_not_lost(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Python drops an exception raised in a weakref callback; the signal must still stop
    the block, and no traceback may be printed."""
    with pytest.raises(KeyboardInterrupt):
        _terminate_in_a_weakref_callback()
    assert "Traceback" not in capsys.readouterr().err


def test_the_previous_handlers_are_back_after_the_block() -> None:
    import sys

    before_signal, before_hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    with sigterm_as_interrupt():
        assert signal.getsignal(signal.SIGTERM) is not before_signal
    assert signal.getsignal(signal.SIGTERM) is before_signal
    assert sys.unraisablehook is before_hook

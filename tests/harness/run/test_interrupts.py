"""SIGTERM as a first Ctrl-C, even when it lands where Python drops exceptions."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import sys
import time
import types
import weakref
from pathlib import Path

import pytest

from kvcanary.canaries.errors import RunIncomplete
from kvcanary.harness.run import rendering
from kvcanary.harness.run.interrupts import sigterm_as_interrupt
from kvcanary.harness.run.progress import ProgressDisplay


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


def test_the_block_records_that_a_signal_fired() -> None:
    with sigterm_as_interrupt() as delivery:
        assert not delivery.fired
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    assert delivery.fired


def test_sigint_goes_through_the_same_handler() -> None:
    with sigterm_as_interrupt() as delivery, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert delivery.fired


class _ExtensionInitModule(types.ModuleType):
    """A module whose attribute lookup behaves like a C extension's init hit by a signal:
    the KeyboardInterrupt is swallowed and comes out as an ImportError (what pandas'
    `PyCapsule_Import` does)."""

    def __getattr__(self, name: str) -> object:
        with contextlib.suppress(KeyboardInterrupt):  # swallowed, as C init code does
            signal.raise_signal(signal.SIGTERM)
        raise ImportError('PyCapsule_Import could not import module "pandas"')


def test_a_signal_inside_an_extension_init_is_an_incomplete_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(
        sys.modules, "kvcanary.reports.render", _ExtensionInitModule("kvcanary.reports.render")
    )
    display = ProgressDisplay(num_requests=1, file=io.StringIO(), live=False)
    with pytest.raises(RunIncomplete, match="kvcanary report"):
        rendering.render(tmp_path, keep_raw_evidence=False, display=display)


def test_an_import_error_without_a_signal_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    class Broken(types.ModuleType):
        def __getattr__(self, name: str) -> object:
            raise ImportError("a broken install")

    monkeypatch.setitem(sys.modules, "kvcanary.reports.render", Broken("kvcanary.reports.render"))
    display = ProgressDisplay(num_requests=1, file=io.StringIO(), live=False)
    with pytest.raises(ImportError, match="a broken install"):
        rendering.render(tmp_path, keep_raw_evidence=False, display=display)

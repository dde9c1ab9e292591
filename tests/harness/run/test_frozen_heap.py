"""`harness.run.wiring.frozen_heap`: the garbage collector's settings over a run's window."""

from __future__ import annotations

import gc

import pytest

from kvcanary.harness.run.wiring import frozen_heap


def test_the_young_generation_waits_longer_during_the_run_and_everything_is_restored() -> None:
    before = gc.get_threshold()
    with frozen_heap():
        during = gc.get_threshold()
        assert gc.get_freeze_count() > 0  # what existed before the run is out of reach
    assert during[0] > before[0]
    assert during[1:] == before[1:]
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_failing_run_restores_the_collector_too() -> None:
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("the run failed")
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0

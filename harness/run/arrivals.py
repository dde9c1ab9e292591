"""When requests start: closed-loop concurrency or open-loop Poisson arrivals.

Open-loop arrival times are absolute: `PoissonArrivals` precomputes each arrival as the
start time plus cumulative exponential gaps, and the runner sleeps *until* that time. A late
wake-up (a busy event loop, a full in-flight cap) therefore never shifts later arrivals; the
lateness is kept as the observation's queue time (`t_sent_ns - t_scheduled_ns`). Relative
sleeps (`sleep(gap)` after each send) would instead drift and hide the slip.

All times are `time.perf_counter_ns()` readings, the clock observations use. This module
knows nothing about plans, phases or HTTP.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

DEFAULT_MAX_IN_FLIGHT = 1024


class Clock(Protocol):
    """The runner's notion of now, and a way to wait for an absolute time."""

    def now_ns(self) -> int: ...

    async def sleep_until(self, t_ns: int) -> None: ...


class MonotonicClock:
    """`perf_counter_ns`, the clock every observation's timestamps come from."""

    def now_ns(self) -> int:
        return time.perf_counter_ns()

    async def sleep_until(self, t_ns: int) -> None:
        delay_ns = t_ns - time.perf_counter_ns()
        if delay_ns > 0:
            await asyncio.sleep(delay_ns / 1e9)


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """`concurrency` workers, each sending its next request as soon as the last one ends."""

    concurrency: int

    def __post_init__(self) -> None:
        assert self.concurrency >= 1, "closed loop needs at least one worker"


@dataclass(frozen=True, slots=True)
class PoissonArrivals:
    """Open loop: arrivals at `rate` per second with exponential gaps, on an absolute clock."""

    rate: float
    seed: int
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    """A safety cap on concurrent requests; waiting for a slot shows up as queue time."""

    def __post_init__(self) -> None:
        assert self.rate > 0, "arrival rate must be positive"
        assert self.max_in_flight >= 1

    def times(self, start_ns: int) -> Iterator[int]:
        """Absolute arrival times from `start_ns`: the first at once, then exponential gaps."""
        rng = random.Random(self.seed)
        offset_ns = 0.0  # summed from zero: the schedule is the same whatever the start
        while True:
            yield start_ns + round(offset_ns)
            offset_ns += rng.expovariate(self.rate) * 1e9


Pacing = ClosedLoop | PoissonArrivals

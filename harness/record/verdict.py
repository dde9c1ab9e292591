"""The one verdict vocabulary and the one exit-status map (the run output contract).

What a run, an audit, a probe, a repro step or a check says about its target, and the exit
status of every `kvcanary` command:

    0  EXIT_CLEAN       the verdict is `clean` (a repro: `reproduced`)
    1  EXIT_FINDINGS    the verdict is `leak` or `unsafe` (a repro: `not reproduced`)
    2  EXIT_USAGE       a usage or configuration error: no verdict at all
    3  EXIT_INCOMPLETE  the verdict is `inconclusive`, the run could not complete, or a clean
                        run's reports could not all be written (`exit_status`)

Which findings make which verdict is decided in `harness.record.judgement`, from the table in
`harness.record.finding`. Nothing else maps a verdict to a number.
"""

from __future__ import annotations

from enum import StrEnum

EXIT_CLEAN = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_INCOMPLETE = 3


class Verdict(StrEnum):
    """What kvcanary concludes about a target (the verdict table: `harness.record.judgement`)."""

    LEAK = "leak"
    """Evidence that one tenant's data reached another."""
    UNSAFE = "unsafe"
    """Protocol defects without evidence of a leak."""
    CLEAN = "clean"
    """Everything planned was sent and judged, and nothing was found."""
    INCONCLUSIVE = "inconclusive"
    """What was planned could not be judged."""

    @property
    def exit_status(self) -> int:
        """0 clean, 1 findings (leak or unsafe), 3 no verdict."""
        return _EXIT_STATUS[self]


_EXIT_STATUS = {
    Verdict.LEAK: EXIT_FINDINGS,
    Verdict.UNSAFE: EXIT_FINDINGS,
    Verdict.CLEAN: EXIT_CLEAN,
    Verdict.INCONCLUSIVE: EXIT_INCOMPLETE,
}


def exit_status(verdict: Verdict, *, reports_complete: bool = True) -> int:
    """The exit status of a command that ends in `verdict`: a clean verdict whose reports (or
    journal check) could not all be completed is 3, never 0 with something missing."""
    if verdict is Verdict.CLEAN and not reports_complete:
        return EXIT_INCOMPLETE
    return verdict.exit_status


class Reproduction(StrEnum):
    """Whether a repro saw what its scenario expected."""

    REPRODUCED = "reproduced"
    NOT_REPRODUCED = "not reproduced"
    INCONCLUSIVE = "inconclusive"

    @property
    def exit_status(self) -> int:
        """0 reproduced, 1 not reproduced, 3 could not tell."""
        return _REPRODUCTION_EXIT_STATUS[self]


_REPRODUCTION_EXIT_STATUS = {
    Reproduction.REPRODUCED: EXIT_CLEAN,
    Reproduction.NOT_REPRODUCED: EXIT_FINDINGS,
    Reproduction.INCONCLUSIVE: EXIT_INCOMPLETE,
}

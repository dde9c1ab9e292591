"""The one verdict vocabulary: what a run, an audit, a probe, a repro step or a check says
about its target, and the exit status each verdict maps to (DESIGN.md, "Run output contract").

    leak          content or timing evidence that one request saw another's data   -> exit 1
    unsafe        a finding that is not itself a leak (a pool smaller than the context,
                  an over-limit prompt accepted) — `kvcanary audit` says this       -> exit 1
    clean         no finding, and the dangerous path was exercised                  -> exit 0
    inconclusive  not enough evidence either way (not reached, not judged)           -> exit 3

A repro is judged against its scenario's *expected* verdict: `Reproduction` says whether
the observed verdict matched. Usage errors (exit 2) are not verdicts; `harness.cli` maps
them, and these exit statuses, in its one place.
"""

from __future__ import annotations

from enum import StrEnum


class Verdict(StrEnum):
    """What kvcanary concludes about a target."""

    LEAK = "leak"
    UNSAFE = "unsafe"
    CLEAN = "clean"
    INCONCLUSIVE = "inconclusive"

    @property
    def exit_status(self) -> int:
        """0 clean, 1 findings (leak or unsafe), 3 no verdict."""
        return _EXIT_STATUS[self]


_EXIT_STATUS = {Verdict.LEAK: 1, Verdict.UNSAFE: 1, Verdict.CLEAN: 0, Verdict.INCONCLUSIVE: 3}


class Reproduction(StrEnum):
    """Whether a repro saw what its scenario expected."""

    REPRODUCED = "reproduced"
    NOT_REPRODUCED = "not reproduced"
    INCONCLUSIVE = "inconclusive"

    @property
    def exit_status(self) -> int:
        """0 reproduced, 1 not reproduced, 3 could not tell."""
        return {"reproduced": 0, "not reproduced": 1, "inconclusive": 3}[self.value]

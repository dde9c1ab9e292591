"""The TTFT model the timing detector used, read back from the journal for the report's plot.

The line in the report must be the timing detector's line, not a look-alike, so the
detector journals its model (`TimingFitted`) whenever it refits and once at the end of a
run; this module returns the last one. A journal without one (a run that ended in an error
before its first fit, or one written before kvcanary journaled its fits) has no line.
"""

from __future__ import annotations

from kvcanary.harness.record.ttft_model import TtftModel
from kvcanary.reports.frames import RunFrames

METHOD = "the timing detector's own fit (harness.detectors.timing), as journaled by the run"


def journaled_ttft(frames: RunFrames) -> tuple[TtftModel | None, str]:
    """The detector's last model, and a note that says where it came from or why there is none."""
    if frames.timing is None:
        return None, "no timing model was journaled (the run ended before its first fit)"
    if frames.timing.model is None:
        return None, "too few accepted requests to fit TTFT against prompt length"
    try:
        return TtftModel.from_dict(frames.timing.model), METHOD
    except ValueError as exc:  # a damaged journal: the report says so instead of a line
        return None, f"the journaled timing model could not be read ({exc})"

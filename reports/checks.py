"""What each check of the finding vocabulary showed, decided once for every renderer.

A check is one finding kind. Its state is, in this order of precedence:

- `found`: the run has findings of that kind;
- `not run`: the run could not have produced that kind (`summary["checks_not_run"]`, with
  why: pool sizes are audited by `kvcanary audit`, the prefix-cache probe is opt-in);
- `not judged`: the timing check could not judge (`summary["timing"]`: the detector said
  so, no fit was journaled or there were too few samples, or no answered prompt was long
  enough for its rule), with why;
- `unproven`: the verdict is inconclusive, so an absent finding proves nothing;
- `passed`: otherwise.

HTML, Markdown and JUnit all render these states, so a check that did not run is never
shown as passed anywhere. This module reads only the summary document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.record.outputs import Summary
from kvcanary.harness.record.verdict import Verdict

CheckStatus = Literal["found", "not run", "not judged", "unproven", "passed"]


@dataclass(frozen=True, slots=True)
class CheckState:
    """One check as every report shows it."""

    kind: str
    num_findings: int
    status: CheckStatus
    why: str
    """Why it did not run, was not judged or proves nothing; empty for found and passed."""

    @property
    def ran(self) -> bool:
        return self.status not in ("not run", "not judged")


def timing_judgement(summary: Summary) -> tuple[bool, str]:
    """Whether the timing detector could judge TTFTs, and why not (or how it judged).

    Not judged: the detector said so (`not_judged`, journaled with its final fit), there was
    no model at all, or no answered prompt was long enough for its rule (`num_judged`).
    """
    timing = summary.get("timing") or {}
    note = str(timing.get("note") or "")
    model = timing.get("model")
    if "judged" in timing:  # the summary decided it (`judged`, and `reason` when not)
        return bool(timing["judged"]), (note if timing["judged"] else str(timing["reason"]))
    if timing.get("not_judged"):
        return False, str(timing["not_judged"])
    if model is None:
        return False, note or "no timing model was journaled"
    if timing.get("num_judged") == 0:
        start = float(model.get("min_eligible_tokens", 0))
        return False, (
            f"the timing rule applies from {start:,.0f} prompt tokens, and no answered "
            "prompt was that long"
        )
    return True, note


def check_states(summary: Summary) -> list[CheckState]:
    """Every check of the vocabulary, in its order, with its state."""
    counts = summary["counts"]["findings"]
    not_run: dict[str, str] = summary.get("checks_not_run", {})
    judged, timing_note = timing_judgement(summary)
    states = []
    for kind in FindingKind:
        name = str(kind)
        num = int(counts.get(name, 0))
        if num:
            states.append(CheckState(name, num, "found", ""))
        elif name in not_run:
            states.append(CheckState(name, 0, "not run", not_run[name]))
        elif kind == FindingKind.FAST_PREFILL and not judged:
            states.append(CheckState(name, 0, "not judged", timing_note))
        elif summary["verdict"] == Verdict.INCONCLUSIVE:
            states.append(
                CheckState(name, 0, "unproven", "inconclusive run: no finding here proves nothing")
            )
        else:
            states.append(CheckState(name, 0, "passed", ""))
    return states

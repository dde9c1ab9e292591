"""A request plan as its journal line holds it: every field but the prompt, the canaries packed.

`PlanLine` declares the line, so every reader derives from it (`harness.record.decoding`,
`harness.record.columns`): `tenants.plan.RequestPlan`'s fields but `prompt`, then
`num_canaries` and `canary_spans`, the plan's canary spans packed (`canaries.packing`: about
14 characters a canary instead of ~90 as JSON objects, every span exactly). Journals written
before the packing list `canaries` as objects; they are read the same. The dataclass is made
from `RequestPlan`'s own declarations, so a field added to plans is journaled with them.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.packing import pack_spans, unpack_spans
from kvcanary.harness.record.decoding import RecordError
from kvcanary.tenants.plan import RequestPlan

_HINTS = typing.get_type_hints(RequestPlan)
_KEPT = [field for field in dataclasses.fields(RequestPlan) if field.name != "prompt"]
_SCALARS = tuple(field.name for field in _KEPT if field.name != "canaries")
"""The fields journaled as they are (the canaries are packed)."""


def _copied(field: dataclasses.Field[Any]) -> tuple[str, Any, Any]:
    if field.default is not dataclasses.MISSING:
        return field.name, _HINTS[field.name], dataclasses.field(default=field.default)
    if field.default_factory is not dataclasses.MISSING:
        factory = field.default_factory
        return field.name, _HINTS[field.name], dataclasses.field(default_factory=factory)
    return field.name, _HINTS[field.name], dataclasses.field()


PlanLine: type = dataclasses.make_dataclass(
    "PlanLine",
    [
        *map(_copied, _KEPT),
        ("num_canaries", int | None, dataclasses.field(default=None)),
        ("canary_spans", str | None, dataclasses.field(default=None)),
    ],
    frozen=True,
    slots=True,
)
PlanLine.__module__ = __name__
PlanLine.__doc__ = "A plan's journal line: the plan but its prompt, its canaries packed."


def plan_record(plan: RequestPlan) -> dict[str, Any]:
    """The plan's record body (no `type`): its fields, the count and the packed spans."""
    body = {name: getattr(plan, name) for name in _SCALARS}
    body["num_canaries"] = len(plan.canaries)
    body["canary_spans"] = pack_spans(plan.canaries)
    return body


def plan_of(line: Any) -> RequestPlan:
    """The plan a decoded `PlanLine` holds (its prompt empty: never journaled)."""
    canaries = line.canaries
    if line.canary_spans is not None:
        try:
            canaries = unpack_spans(line.canary_spans)
        except CanaryError as exc:
            raise RecordError(f"plan.canary_spans: {exc}") from None
        if line.num_canaries is not None and line.num_canaries != len(canaries):
            raise RecordError("plan.num_canaries: not the number of packed canaries")
    fields = {name: getattr(line, name) for name in _SCALARS}
    return RequestPlan(prompt="", canaries=canaries, **fields)

"""What a scan found, whose it is, and how it relates to the response it was found in.

A `Hit` is one canary (or canary fragment) in a response, with offsets into the whole
response text, the detection layer that found it, and, as far as they are known, the
canary it belongs to, its decoded origin and its owner. `classify` relates a hit to the
request that received the response: its own canary echoed, the same tenant's other
request, another tenant, or unknown origin. This module knows nothing about scanning.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from kvcanary.canaries.mint import CanaryOrigin
from kvcanary.canaries.records import gc_paused as gc_paused  # the index's import
from kvcanary.canaries.records import records_from_columns

Layer = Literal["exact", "normalized", "fragment"]


@dataclass(frozen=True, slots=True)
class Owner:
    """Who a canary was laced for: a tenant and one of its requests."""

    tenant: str
    request_id: str


@dataclass(frozen=True, slots=True)
class Hit:
    """A canary found in a response.

    `text` is the response's own text at [start, end). `layer`: "exact" (the canonical
    canary verbatim), "normalized" (the canary disguised by case, separators, zero-width
    or compatibility characters) or "fragment" (a run of a live canary's words without
    its tag). `canary` is the canonical canary (for a canary of unknown origin, its
    canary-shaped text); `origin` is set when this run's key decodes it; `owner` when the
    canary is live in the index or `owner_of` resolves its origin. No owner: unknown origin.
    """

    text: str
    start: int
    end: int
    layer: Layer
    canary: str | None
    origin: CanaryOrigin | None
    owner: Owner | None


_FIELDS = ("text", "start", "end", "layer", "canary", "origin", "owner")
assert Hit.__slots__ == _FIELDS


def hits_from_columns(
    texts: list[str],
    starts: Iterable[int],
    ends: Iterable[int],
    layers: Iterable[Layer],
    canaries: Iterable[str | None],
    origins: Iterable[CanaryOrigin | None],
    owners: Iterable[Owner | None],
) -> list[Hit]:
    """Many hits at once, equal to `Hit(*row)` for each row (one per text): the echo of a
    1M-token prompt holds ~105k canaries (`canaries.records`: one C loop where it was
    built; the compiled scanner makes its exact hits the same way itself)."""
    columns = (texts, starts, ends, layers, canaries, origins, owners)
    return list(records_from_columns(Hit, _FIELDS, *columns))


class Relation(StrEnum):
    """How a hit relates to the request whose response contained it."""

    OWN = "own"
    SAME_TENANT = "same_tenant"
    OTHER_TENANT = "other_tenant"
    UNKNOWN = "unknown"


def classify(hit: Hit, *, tenant: str, request_id: str) -> Relation:
    """The relation of `hit` to the request (tenant, request_id) that received it."""
    if hit.owner is None:
        return Relation.UNKNOWN
    if hit.owner.tenant != tenant:
        return Relation.OTHER_TENANT
    if hit.owner.request_id == request_id:
        return Relation.OWN
    return Relation.SAME_TENANT

"""Candidate matches of the index's reference layers, and which of overlapping ones wins.

Where matches overlap, one wins: a tag match that resolves (live or decrypting) beats a
fragment, which beats a tag match of unknown origin (`canaries.index`). This module holds
the candidate (`Match`) and the rules; the index finds the candidates.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from kvcanary.canaries.hit import Layer, Owner
from kvcanary.canaries.mint import CanaryOrigin


def outside_live_tags(
    fragments: list[Match], tags: list[Match], live: dict[str, Owner]
) -> list[Match]:
    """The fragments that overlap no tag match of a live canary (which would win anyway:
    dropping them here saves resolving them, in the common case of an echoed canary)."""
    if not fragments:
        return fragments
    live_tags = [t for t in tags if t.canary in live]  # in order; tag matches never overlap
    starts = [t.start for t in live_tags]

    def overlaps_a_live_tag(fragment: Match) -> bool:
        last = bisect_left(starts, fragment.end) - 1  # the last live tag starting before end
        return last >= 0 and live_tags[last].end > fragment.start

    return [f for f in fragments if not overlaps_a_live_tag(f)]


def winners(
    candidates: list[tuple[int, int, Match]],
    origins: dict[str, CanaryOrigin | None],
    live: dict[str, Owner],
) -> list[tuple[int, int, Match]]:
    """Candidates that overlap no better one, in text order. Better: a tag match that
    resolves (live or decrypting), then a fragment, then a tag match of unknown origin;
    between equals, the longer, then the earlier. Overlaps are local, so candidates are
    resolved per cluster of overlapping spans (one sort, then small clusters)."""

    def rank(item: tuple[int, int, Match]) -> tuple[int, int, int]:
        start, end, match = item
        if match.layer == "fragment":
            tier = 1
        elif match.canary in live or origins.get(match.canary) is not None:
            tier = 0
        else:
            tier = 2
        return tier, start - end, start

    def resolve(cluster: list[tuple[int, int, Match]]) -> list[tuple[int, int, Match]]:
        if len(cluster) == 1:
            return cluster
        if len(cluster) == 2:  # the common case: a tag match and the fragment inside it
            return [min(cluster, key=rank)]  # members of a cluster of two overlap
        chosen: list[tuple[int, int, Match]] = []
        for item in sorted(cluster, key=rank):
            if all(item[1] <= other[0] or other[1] <= item[0] for other in chosen):
                chosen.append(item)
        return sorted(chosen, key=lambda item: item[0])

    kept: list[tuple[int, int, Match]] = []
    cluster: list[tuple[int, int, Match]] = []
    cluster_end = 0
    for item in sorted(candidates, key=lambda item: item[:2]):
        if cluster and item[0] >= cluster_end:
            kept += resolve(cluster)
            cluster = []
        cluster_end = max(cluster_end, item[1]) if cluster else item[1]
        cluster.append(item)
    return kept + resolve(cluster) if cluster else kept


def fragment_entry(entry: str | tuple[str, int] | None) -> tuple[str, int]:
    """(canary, word offset) of a fragment-dict entry; ("", 0) for none."""
    if entry is None:
        return "", 0
    return (entry, 0) if isinstance(entry, str) else entry


@dataclass(frozen=True, slots=True)
class Match:
    """A candidate in folded coordinates; `complete` when `canary` has num_words words
    (always, for a fragment); `num_words` of them were matched (a fragment's length)."""

    start: int
    end: int
    layer: Layer
    canary: str
    complete: bool
    num_words: int

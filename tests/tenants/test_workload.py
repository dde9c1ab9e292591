"""Workload profiles resolved against incident-shaped and sane limits."""

from __future__ import annotations

import dataclasses

import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.events import Limits
from kvcanary.tenants.size import size
from kvcanary.tenants.workload import PROFILES, WorkloadProfile, get_profile, profile_names

INCIDENT = Limits(pool_tokens=1024, context_tokens=8192, page_size=16, source="flags")
SANE = Limits(pool_tokens=65536, context_tokens=8192, page_size=16, source="flags")


def test_incident_profile_on_an_incident_deployment() -> None:
    resolved = get_profile("incident").resolve(INCIDENT)
    assert [v.num_tokens for v in resolved.victims] == [512, 256, 128, 1023]
    assert {v.expected for v in resolved.victims} == {"accept"}
    assert {v.intent for v in resolved.victims} == {"victim"}
    assert [(p.label, p.num_tokens) for p in resolved.probes] == [
        ("pool", 1024),
        ("pool+1", 1025),
        ("(pool+context)/2", 4608),
        ("context-1", 8191),
        ("context", 8192),
        ("context+1", 8193),
    ]
    # every probe but the one exactly at the pool (a boundary probe) exceeds it, so a safe
    # target rejects them
    assert {p.label: p.expected for p in resolved.probes} == {
        "pool": "boundary",
        "pool+1": "reject",
        "(pool+context)/2": "reject",
        "context-1": "reject",
        "context": "reject",
        "context+1": "reject",
    }
    assert [(a.intent, a.expected) for a in resolved.aborts] == [("abort", "accept")]


def test_incident_profile_on_a_sane_deployment() -> None:
    resolved = get_profile("incident").resolve(SANE)
    # `limit-1` leaves no room for its 16-token answer: an engine not identified may take
    # it or refuse it (a boundary), the others are accepted
    assert [v.expected for v in resolved.victims] == ["accept", "accept", "accept", "boundary"]
    assert max(v.num_tokens for v in resolved.victims) == 8191  # below the context
    expected = {p.label: p.expected for p in resolved.probes}
    assert expected == {
        "pool": "reject",
        "pool+1": "reject",
        "(pool+context)/2": "reject",
        "context-1": "boundary",  # 8191 + 64 tokens of answer do not fit the context
        "context": "boundary",
        "context+1": "reject",
    }


@pytest.mark.parametrize(
    ("policy", "within_the_context"), [("reject", "boundary"), ("stop", "accept")]
)
def test_a_prompt_whose_answer_cannot_fit_follows_the_engines_convention(
    policy: str, within_the_context: str
) -> None:
    """vLLM and SGLang refuse prompt + max_tokens above the context (either answer is
    defensible: a boundary); llama.cpp answers until its context is full (accepted). Either
    way the prompt itself fits: never a reject, so never an unsafe_accept."""
    limits = dataclasses.replace(SANE, max_tokens_policy=policy)
    resolved = get_profile("incident").resolve(limits)
    assert resolved.victims[-1].expected == within_the_context  # limit-1, 16 tokens of answer
    expected = {p.label: p.expected for p in resolved.probes}
    assert expected["context-1"] == within_the_context
    assert (expected["context"], expected["context+1"]) == ("boundary", "reject")
    assert [v.expected for v in resolved.victims[:3]] == ["accept"] * 3


def test_limits_profile_edges() -> None:
    probes = get_profile("limits").resolve(INCIDENT).probes
    assert {p.label: p.expected for p in probes} == {
        "pool-1": "accept",
        "pool": "boundary",
        "pool+1": "reject",
        "context-1": "reject",
        "context": "reject",
        "context+1": "reject",
    }


@pytest.mark.parametrize("limits", [INCIDENT, SANE])
def test_below_profile_stays_below_every_limit(limits: Limits) -> None:
    resolved = get_profile("below").resolve(limits)
    sizes = resolved.victims + resolved.probes
    # `limit-1` with its answer may not fit the context (SANE): a boundary, never a reject
    assert {s.expected for s in sizes} <= {"accept", "boundary"}
    assert max(s.num_tokens for s in sizes) < min(limits.pool_tokens, limits.context_tokens)


def test_profiles_are_named_and_unknown_names_list_the_choices() -> None:
    assert profile_names()[0] == "incident"
    assert set(PROFILES) == {"incident", "limits", "below", "race"}
    with pytest.raises(ConfigError, match="incident, limits, below"):
        get_profile("nope")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"victims": (), "probes": ()}, "no victim or probe"),
        ({"victim_fraction": 1.5}, "victim_fraction"),
        ({"probe_max_tokens": 0}, "max_tokens"),
        ({"abort_after_chunks": -1}, "abort_after_chunks"),
    ],
)
def test_invalid_profiles(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "name": "custom",
        "description": "d",
        "victims": [size("0.5*limit", "victim")],
        "probes": [size("pool+1", "probe")],
    }
    with pytest.raises(ConfigError, match=message):
        WorkloadProfile(**(fields | kwargs))  # type: ignore[arg-type]


def test_custom_profile_accepts_lists() -> None:
    profile = WorkloadProfile(
        name="custom",
        description="d",
        victims=[size("100", "victim")],
        probes=[size("limit", "probe")],
    )
    assert isinstance(profile.victims, tuple)
    assert profile.resolve(INCIDENT).probes[0].num_tokens == 1024

"""Size expressions over the target's limits, and the accept/boundary/reject rule at every edge."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.events import Limits
from kvcanary.tenants.size import SizeSpec, evaluate, expected_outcome, input_limit, size


@dataclass(frozen=True)
class FakeLimits:
    pool_tokens: int
    context_tokens: int
    page_size: int = 16
    max_input_tokens: int | None = None
    max_tokens_policy: str | None = None


INCIDENT = FakeLimits(pool_tokens=1000, context_tokens=4096)


@pytest.mark.parametrize(
    ("expr", "num_tokens"),
    [
        ("0.5*pool", 500),
        ("pool-1", 999),
        ("pool", 1000),
        ("pool+1", 1001),
        ("(pool+context)/2", 2548),
        ("context", 4096),
        ("context+1", 4097),
        ("context-1", 4095),
        ("4096", 4096),
        ("page*4", 64),
        ("limit-1", 999),
        ("pool/3", 333),  # rounded down
        (" -pool + 2 * context ", 7192),
        ("2.5e2", 250),
    ],
)
def test_expressions(expr: str, num_tokens: int) -> None:
    assert evaluate(expr, INCIDENT) == num_tokens


@pytest.mark.parametrize(
    "expr",
    [
        "pool**2",
        "__import__('os').system('true')",
        "pool.bit_length()",
        "pool[0]",
        "min(pool, context)",
        "foo+1",
        "",
        "pool +",
        "1/0",
        "True",
        "'1000'",
        "lambda: 1",
        "pool if context else 1",
        "0.5*pool-1000",
        "1e308*1e308",
        "pool; import os",
    ],
)
def test_bad_expressions_are_config_errors_quoting_them(expr: str) -> None:
    with pytest.raises(ConfigError) as info:
        evaluate(expr, INCIDENT)
    assert repr(expr) in str(info.value)


def test_overlong_expressions_are_refused() -> None:
    with pytest.raises(ConfigError, match="longer than"):
        evaluate("+".join(["pool"] * 100), INCIDENT)


names = st.sampled_from(["pool", "context", "page", "limit"])
leaves = st.one_of(names, st.integers(0, 10_000).map(str))
expressions = st.recursive(
    leaves,
    lambda inner: st.tuples(inner, st.sampled_from("+-*"), inner).map(
        lambda t: f"({t[0]}{t[1]}{t[2]})"
    ),
    max_leaves=8,
)


@given(expressions)
def test_evaluation_agrees_with_python_arithmetic(expr: str) -> None:
    env = {"pool": 1000, "context": 4096, "page": 16, "limit": 1000}
    value = eval(expr, {"__builtins__": {}}, env)  # generated arithmetic only
    if value >= 1:
        assert evaluate(expr, INCIDENT) == value
    else:
        with pytest.raises(ConfigError, match="at least 1"):
            evaluate(expr, INCIDENT)


@pytest.mark.parametrize(
    ("limits", "limit"),
    [
        (FakeLimits(1000, 4096), 1000),  # the incident: a pool smaller than the context
        (FakeLimits(8192, 4096), 4096),  # a sane deployment: the context binds
        (FakeLimits(8192, 4096, max_input_tokens=2000), 2000),
        (FakeLimits(1000, 4096, max_input_tokens=4095), 1000),
    ],
)
def test_expected_outcome_at_each_edge(limits: FakeLimits, limit: int) -> None:
    assert input_limit(limits) == limit
    assert expected_outcome(limit - 1, limits) == "accept"
    assert expected_outcome(limit, limits) == "boundary"  # exactly at it: either is defensible
    assert expected_outcome(limit + 1, limits) == "reject"
    assert expected_outcome(1, limits) == "accept"


def test_spec_resolution_derives_or_keeps_expected() -> None:
    limits = Limits(pool_tokens=1000, context_tokens=4096, page_size=16, source="flags")
    derived = size("pool + 1", "probe").resolve(limits)
    assert (derived.label, derived.num_tokens, derived.expected) == ("pool+1", 1001, "reject")
    forced = SizeSpec("odd", "pool+1", "probe", expected="accept").resolve(limits)
    assert forced.expected == "accept"
    with pytest.raises(ConfigError, match="unknown name"):
        SizeSpec("bad", "pools", "probe")


@pytest.mark.parametrize(
    ("policy", "expected"), [("reject", "boundary"), ("stop", "accept"), (None, "boundary")]
)
def test_a_prompt_that_fits_but_its_answer_does_not_follows_the_engine(
    policy: str | None, expected: str
) -> None:
    limits = Limits(8192, 4096, 16, "flags", max_tokens_policy=policy)
    assert expected_outcome(4000, limits, max_tokens=64) == "accept"  # 4064 fits the context
    assert expected_outcome(4033, limits, max_tokens=64) == expected  # 4097 does not
    assert expected_outcome(4032, limits, max_tokens=64) == "accept"  # exactly the context
    assert expected_outcome(4096, limits, max_tokens=64) == "boundary"  # the prompt: at it
    assert expected_outcome(4097, limits, max_tokens=64) == "reject"  # and above it

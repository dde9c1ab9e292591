"""The planner with the real cl100k tokenizer: exact sizes, unique first canaries,
attribution, weighted tenants and determinism from the seed."""

from __future__ import annotations

import hashlib
import itertools
import re
from collections import Counter
from collections.abc import Sequence

import pytest

from kvcanary.canaries import CanaryMinter, Owner, Tokenizer, load_tokenizer
from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.record.events import Limits, PlanRecorded, to_record
from kvcanary.tenants.plan import ApiStyle, RequestPlan
from kvcanary.tenants.planner import Planner
from kvcanary.tenants.size import size
from kvcanary.tenants.tenant import Tenant, default_tenants
from kvcanary.tenants.workload import get_profile

LIMITS = Limits(pool_tokens=256, context_tokens=1024, page_size=16, source="flags")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("cl100k_base")


def make_planner(
    tokenizer: Tokenizer,
    api: ApiStyle = "chat",
    *,
    seed: int = 7,
    tenants: list[Tenant] | None = None,
    chat_overhead_tokens: int = 0,
    profile: str = "incident",
    page_size: int = 16,
) -> Planner:
    return Planner(
        tenants or default_tenants(3),
        get_profile(profile),
        tokenizer,
        CanaryMinter.from_seed(seed, "run-test"),
        LIMITS,
        api=api,
        page_size=page_size,
        seed=seed,
        chat_overhead_tokens=chat_overhead_tokens,
    )


def every_plan(planner: Planner) -> list[RequestPlan]:
    return [
        *planner.victims(rounds=1),
        *planner.probes(rounds=1),
        *planner.abort_plans(rounds=1),
    ]


@pytest.mark.parametrize(("api", "overhead"), [("completions", 0), ("chat", 0), ("chat", 9)])
def test_every_prompt_has_exactly_the_planned_token_count(
    tokenizer: Tokenizer, api: ApiStyle, overhead: int
) -> None:
    planner = make_planner(tokenizer, api, chat_overhead_tokens=overhead)
    plans = every_plan(planner)
    assert len(plans) == 4 + 6 + 1
    for plan in plans:
        assert tokenizer.count(plan.prompt) + overhead == plan.num_prompt_tokens, plan.size_label
        assert plan.api == api
    sizes = {plan.size_label: plan.num_prompt_tokens for plan in plans}
    assert sizes["pool+1"] == 257
    assert sizes["context+1"] == 1025
    assert sizes["limit-1"] == 255


def test_chat_prompts_end_with_the_instruction_and_open_with_the_canary(
    tokenizer: Tokenizer,
) -> None:
    chat = next(make_planner(tokenizer, "chat").victims())
    completion = next(make_planner(tokenizer, "completions").victims())
    assert chat.prompt.endswith("word for word, from its first word to its last.")
    assert "Repeat" not in completion.prompt
    for plan in (chat, completion):
        first = plan.canaries[0]
        assert (first.index, first.token_offset) == (0, 0)
        assert plan.prompt[first.char_offset :].startswith(first.text)
        assert plan.prompt[: first.char_offset].strip() == ""


def test_first_canaries_are_unique_and_attributable(tokenizer: Tokenizer) -> None:
    planner = make_planner(tokenizer, "completions")
    plans = every_plan(planner) + every_plan(planner)
    firsts = [plan.canaries[0].text for plan in plans]
    assert len(set(firsts)) == len(plans)
    assert len({plan.request_id for plan in plans}) == len(plans)
    for plan in plans:
        for canary in (plan.canaries[0], plan.canaries[-1]):
            origin = planner.minter.attribute(canary.text)
            assert origin is not None
            assert planner.owner_of(origin) == Owner(plan.tenant, plan.request_id)


def test_plans_are_deterministic_from_the_seed(tokenizer: Tokenizer) -> None:
    def fingerprint(planner: Planner) -> list[tuple[str, str, str]]:
        return [(p.request_id, p.tenant, p.prompt_sha256) for p in every_plan(planner)]

    assert fingerprint(make_planner(tokenizer, seed=7)) == fingerprint(
        make_planner(tokenizer, seed=7)
    )
    assert fingerprint(make_planner(tokenizer, seed=7)) != fingerprint(
        make_planner(tokenizer, seed=8)
    )


def test_plan_fields(tokenizer: Tokenizer) -> None:
    planner = make_planner(tokenizer, "chat")
    profile = planner.profile
    victim = next(planner.victims())
    probe = next(planner.probes())
    abort = next(planner.abort_plans())
    assert victim.request_id == f"t{victim.tenant.removeprefix('tenant-')}-r000000"
    assert (victim.intent, victim.expected, victim.phase) == ("victim", "accept", "fill")
    # the first probe is exactly the pool (a boundary probe); the ones after it exceed it
    assert (probe.intent, probe.expected, probe.phase) == ("probe", "boundary", "probe")
    assert probe.num_prompt_tokens == LIMITS.pool_tokens
    over = [p for p in planner.probes(rounds=1) if p.num_prompt_tokens > LIMITS.pool_tokens]
    assert over
    assert {p.expected for p in over} == {"reject"}
    assert (abort.intent, abort.phase) == ("abort", "abort")
    assert victim.max_tokens == profile.victim_max_tokens
    assert probe.max_tokens == abort.max_tokens == profile.probe_max_tokens
    assert abort.disconnect_after_chunks == profile.abort_after_chunks
    assert victim.disconnect_after_chunks is None
    assert victim.prompt_sha256 == hashlib.sha256(victim.prompt.encode()).hexdigest()
    record = to_record(PlanRecorded(victim))
    assert "prompt" not in record
    assert victim.prompt not in str(record)
    assert record["prompt_sha256"] == victim.prompt_sha256


def test_one_plan_from_a_spec(tokenizer: Tokenizer) -> None:
    planner = make_planner(tokenizer, "completions")
    plan = planner.plan("control", "control", size("3*page", "control", "accept"), 2)
    assert (plan.tenant, plan.num_prompt_tokens, plan.size_label) == ("tenant-2", 48, "3*page")
    assert tokenizer.count(plan.prompt) == 48


def test_tenants_are_drawn_by_weight(tokenizer: Tokenizer) -> None:
    tenants = [Tenant("heavy", weight=3.0), Tenant("light", weight=1.0)]
    planner = make_planner(tokenizer, tenants=tenants)
    counts = Counter(planner.next_tenant() for _ in range(2000))
    assert 1350 < counts[0] < 1650  # 1500 expected; the draw is fixed by the seed
    plans = list(itertools.islice(planner.victims(), 40))
    assert {p.tenant for p in plans} == {"heavy", "light"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"page_size": 8}, "cannot be built"),
        ({"tenants": [Tenant("a"), Tenant("a")]}, "unique"),
        ({"chat_overhead_tokens": -1}, "negative"),
    ],
)
def test_unusable_settings_are_config_errors(
    tokenizer: Tokenizer, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        next(make_planner(tokenizer, **kwargs).victims())  # type: ignore[arg-type]


def test_a_size_too_small_for_a_chat_prompt_names_the_size(tokenizer: Tokenizer) -> None:
    planner = make_planner(tokenizer, "chat", chat_overhead_tokens=10)
    with pytest.raises(ConfigError, match="'12'"):
        planner.plan("fill", "victim", size("12", "victim"), 0)


class SkewedTokenizer:
    """cl100k, except that a space-newline right after text counts `skew` tokens more: -1
    models a tokenizer merging across the boundary (fixed by a nudged body size), +100 a
    separator that can never fit (fixed by the next separator)."""

    def __init__(self, inner: Tokenizer, skew: int) -> None:
        self._inner = inner
        self._skew = skew
        self.name = inner.name
        self.vocab_size = inner.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._inner.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._inner.decode(ids)

    def count(self, text: str) -> int:
        return self._inner.count(text) + self._skew * len(re.findall(r"\S \n\n", text))


@pytest.mark.parametrize("skew", [-1, 100])
def test_chat_fitting_survives_boundary_merges(tokenizer: Tokenizer, skew: int) -> None:
    skewed = SkewedTokenizer(tokenizer, skew)
    planner = make_planner(skewed, "chat")
    for plan in [*planner.victims(rounds=1), *planner.probes(rounds=1)]:
        assert skewed.count(plan.prompt) == plan.num_prompt_tokens
        assert (" \n\nRepeat" in plan.prompt) == (skew == -1)

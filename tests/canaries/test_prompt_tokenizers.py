"""Prompts in real tokenizers at page size 16 (property tests): DeepSeek V3's tokenizer.json
and cl100k_base, each with its own canary alphabet, give prompts of the exact count whose
canaries sit where the spans say, with a complete canary in every 16-token window."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_prompt import check_prompt

from kvcanary.canaries import CanaryMinter, Tokenizer, build_prompt
from kvcanary.canaries.alphabet import alphabet_for

PAGE_SIZE = 16
_PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
_PROMPTS = {
    "n": st.integers(1, 4000),
    "filler": st.sampled_from(["prose", "none"]),
    "seed": st.integers(0, 1000),
    "tenant": st.integers(0, 255),
    "request": st.integers(0, 4_000_000),
}


def check_page_16(
    tokenizer: Tokenizer, n: int, filler: str, seed: int, tenant: int, request: int
) -> None:
    minter = CanaryMinter.from_seed(seed, "page-16", alphabet=alphabet_for(tokenizer))
    assert 2 * minter.num_tokens(tokenizer) - 1 <= PAGE_SIZE  # per page, no fallback
    prompt = build_prompt(
        tokenizer, minter, tenant=tenant, request=request, num_tokens=n,
        page_size=PAGE_SIZE, filler=filler, seed=seed,  # type: ignore[arg-type]
    )  # fmt: skip
    check_prompt(prompt, tokenizer, minter, tenant=tenant, request=request, page_size=PAGE_SIZE)


@_PROPERTY
@example(n=4000, filler="prose", seed=1, tenant=2, request=3)
@example(n=9, filler="none", seed=0, tenant=0, request=0)
@given(**_PROMPTS)
def test_deepseek_prompts_at_page_16_are_exact_and_owned(
    deepseek: Tokenizer, n: int, filler: str, seed: int, tenant: int, request: int
) -> None:
    check_page_16(deepseek, n, filler, seed, tenant, request)


@_PROPERTY
@example(n=4000, filler="prose", seed=1, tenant=2, request=3)
@given(**_PROMPTS)
def test_cl100k_prompts_at_page_16_are_exact_and_owned(
    cl100k: Tokenizer, n: int, filler: str, seed: int, tenant: int, request: int
) -> None:
    check_page_16(cl100k, n, filler, seed, tenant, request)


def test_the_default_alphabet_would_not_fit_deepseek_pages_of_16(deepseek: Tokenizer) -> None:
    """Why the alphabet matters: spelled with every list word, DeepSeek canaries may take
    up to 20 tokens, so pages of 16 could not each hold one."""
    assert CanaryMinter.from_seed(0, "x").num_tokens(deepseek) > (PAGE_SIZE + 1) // 2
    with pytest.raises(ValueError, match="page size 16 cannot hold"):
        build_prompt(deepseek, CanaryMinter.from_seed(0, "x"), tenant=0, request=0, num_tokens=99)

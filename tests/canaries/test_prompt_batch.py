"""Prompts built in a batch are the prompts built one at a time; counts exact without a count."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcanary.canaries.prompt as prompt_module
from kvcanary.canaries import CanaryError, CanaryMinter, Tokenizer, build_prompt, load_tokenizer
from kvcanary.canaries.prompt import PromptRequest, batch_settings, build_prompts
from kvcanary.canaries.tokenizer import pieces_add_up


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 2500), min_size=1, max_size=12),
    page_size=st.sampled_from([13, 16, 40, 64]),
    filler=st.sampled_from(["prose", "none"]),
    seed=st.integers(0, 100),
)
def test_a_batch_gives_the_prompts_built_one_at_a_time(
    cl100k: Tokenizer,
    minter: CanaryMinter,
    sizes: list[int],
    page_size: int,
    filler: str,
    seed: int,
) -> None:
    wanted = [PromptRequest(i % 7, 1000 + i, n) for i, n in enumerate(sizes)]
    settings = batch_settings(cl100k, minter, page_size=page_size, filler=filler, seed=seed)  # type: ignore[arg-type]
    batch = build_prompts(cl100k, minter, wanted, settings)
    for one, prompt in zip(wanted, batch, strict=True):
        alone = build_prompt(
            cl100k,
            minter,
            tenant=one.tenant,
            request=one.request,
            num_tokens=one.num_tokens,
            page_size=page_size,
            filler=filler,  # type: ignore[arg-type]
            seed=seed,
        )
        assert prompt == alone
        assert cl100k.count(prompt.text) == one.num_tokens


def test_long_and_short_prompts_mix_in_one_batch(
    cl100k: Tokenizer, minter: CanaryMinter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prompt_module, "_SMALL_CANARIES", 50)  # 600 tokens: the chunked path
    wanted = [PromptRequest(1, 1, 300), PromptRequest(1, 2, 6000), PromptRequest(2, 3, 5)]
    settings = batch_settings(cl100k, minter, page_size=16, filler="prose", seed=1)
    batch = build_prompts(cl100k, minter, wanted, settings)
    assert [p.num_tokens for p in batch] == [300, 6000, 5]
    assert [cl100k.count(p.text) for p in batch] == [300, 6000, 5]
    monkeypatch.undo()
    assert build_prompts(cl100k, minter, wanted, settings) == batch


def test_only_a_tokenizer_whose_pieces_provably_add_up_skips_the_count(
    cl100k: Tokenizer, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    assert pieces_add_up(cl100k)
    vocab = {"[UNK]": 0, "a": 1}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    assert not pieces_add_up(load_tokenizer(str(tmp_path / "tokenizer.json")))


def test_a_bad_size_in_a_batch_is_an_error(cl100k: Tokenizer, minter: CanaryMinter) -> None:
    settings = batch_settings(cl100k, minter, page_size=16, filler="prose", seed=0)
    with pytest.raises(CanaryError, match="leave no room"):
        build_prompts(cl100k, minter, [PromptRequest(0, 0, 10), PromptRequest(0, 1, 0)], settings)

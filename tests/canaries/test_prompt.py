"""Prompts: exact token counts, canary density per page, offsets, prose, repair, errors."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvcanary.canaries.prompt as prompt_module
from kvcanary.canaries import (
    TAG,
    WORDS,
    BuiltPrompt,
    CanaryError,
    CanaryMinter,
    CanaryOrigin,
    Tokenizer,
    build_prompt,
    load_tokenizer,
)
from kvcanary.canaries.mint import NUM_INDICES


def check_prompt(
    prompt: BuiltPrompt,
    tokenizer: Tokenizer,
    minter: CanaryMinter,
    *,
    tenant: int,
    request: int,
    page_size: int,
) -> list[int]:
    """Asserts every guarantee of a built prompt against a real encoding."""
    tokens = tokenizer.encode(prompt.text)
    assert len(tokens) == prompt.num_tokens
    c = minter.num_tokens(tokenizer)
    if prompt.num_tokens < c:
        assert prompt.canaries == ()
        # the tag and words, or, where the tag itself takes several tokens, a prefix of it
        assert prompt.text.startswith(" " + TAG) or (" " + TAG).startswith(prompt.text)
        return tokens
    starts = []
    for i, span in enumerate(prompt.canaries):
        assert span.index == i
        assert prompt.text[span.char_offset : span.char_offset + len(span.text)] == span.text
        piece = tokenizer.decode(tokens[span.token_offset : span.token_offset + c])
        assert piece == " " + span.text
        starts.append(span.token_offset)
    assert starts[0] == 0
    origins = minter.attribute_many([span.text for span in prompt.canaries])
    assert origins == [CanaryOrigin(tenant, request, i) for i in range(len(starts))]
    check_every_window(starts, c, prompt.num_tokens, page_size)
    return tokens


def check_every_window(starts: Sequence[int], c: int, n: int, page_size: int) -> None:
    """Every window [s, s + P) for s in 0..n-P holds a complete canary."""
    windows = np.arange(0, max(n - page_size + 1, 0))
    first = np.searchsorted(np.asarray(starts), windows, side="left")
    assert (first < len(starts)).all(), "a window after the last canary"
    assert (np.asarray(starts)[first] + c <= windows + page_size).all(), "an uncovered window"


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 3000),
    page_size=st.integers(13, 96),
    filler=st.sampled_from(["prose", "none"]),
    seed=st.integers(0, 1000),
    tenant=st.integers(0, 255),
    request=st.integers(0, 4_000_000),
)
def test_small_prompts_keep_every_guarantee(
    cl100k: Tokenizer,
    minter: CanaryMinter,
    n: int,
    page_size: int,
    filler: str,
    seed: int,
    tenant: int,
    request: int,
) -> None:
    prompt = build_prompt(
        cl100k, minter, tenant=tenant, request=request, num_tokens=n,
        page_size=page_size, filler=filler, seed=seed,  # type: ignore[arg-type]
    )  # fmt: skip
    check_prompt(prompt, cl100k, minter, tenant=tenant, request=request, page_size=page_size)


@settings(max_examples=10, deadline=None)
@example(n=200_000, page_size=13, seed=1)
@example(n=131_073, page_size=16, seed=2)
@example(n=100_003, page_size=64, seed=3)
@given(
    n=st.integers(3000, 200_000),
    page_size=st.sampled_from([13, 16, 32, 64, 256]),
    seed=st.integers(0, 1000),
)
def test_large_prompts_keep_every_guarantee(
    cl100k: Tokenizer, minter: CanaryMinter, n: int, page_size: int, seed: int
) -> None:
    prompt = build_prompt(
        cl100k, minter, tenant=4, request=5, num_tokens=n, page_size=page_size, seed=seed
    )
    check_prompt(prompt, cl100k, minter, tenant=4, request=5, page_size=page_size)


@pytest.mark.parametrize("num_words", [7, 8, 10])
def test_longer_canaries_need_larger_pages(cl100k: Tokenizer, num_words: int) -> None:
    minter = CanaryMinter.from_seed(1, "long", num_words=num_words)
    c = num_words + 1
    prompt = build_prompt(cl100k, minter, tenant=1, request=1, num_tokens=777, page_size=2 * c - 1)
    check_prompt(prompt, cl100k, minter, tenant=1, request=1, page_size=2 * c - 1)
    with pytest.raises(CanaryError, match=rf"at least {2 * c - 1}"):
        build_prompt(cl100k, minter, tenant=1, request=1, num_tokens=777, page_size=2 * c - 2)


def test_page_size_that_cannot_be_met_names_the_limit(
    cl100k: Tokenizer, minter: CanaryMinter
) -> None:
    with pytest.raises(CanaryError, match=r"c <= \(P \+ 1\) / 2.*at least 13"):
        build_prompt(cl100k, minter, tenant=0, request=0, num_tokens=100, page_size=12)


def test_tiny_prompts_are_prefixes_of_the_first_canary(
    cl100k: Tokenizer, minter: CanaryMinter
) -> None:
    first = minter.mint(2, 9, 0)
    for n in range(1, 7):
        prompt = build_prompt(cl100k, minter, tenant=2, request=9, num_tokens=n)
        assert cl100k.count(prompt.text) == n
        assert prompt.canaries == ()
        assert (" " + first).startswith(prompt.text)
    assert build_prompt(cl100k, minter, tenant=2, request=9, num_tokens=1).text == " " + TAG
    seven = build_prompt(cl100k, minter, tenant=2, request=9, num_tokens=7)
    assert seven.text == " " + first
    assert len(seven.canaries) == 1


def test_first_tokens_are_unique_per_request(cl100k: Tokenizer, minter: CanaryMinter) -> None:
    heads = set()
    for tenant, request in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        prompt = build_prompt(cl100k, minter, tenant=tenant, request=request, num_tokens=500)
        heads.add(tuple(cl100k.encode(prompt.text)[:7]))
    assert len(heads) == 4


def test_overhead_is_subtracted(cl100k: Tokenizer, minter: CanaryMinter) -> None:
    prompt = build_prompt(cl100k, minter, tenant=0, request=0, num_tokens=1000, overhead_tokens=11)
    assert prompt.num_tokens == 989 == cl100k.count(prompt.text)
    with pytest.raises(CanaryError, match="no room"):
        build_prompt(cl100k, minter, tenant=0, request=0, num_tokens=11, overhead_tokens=11)


def test_bad_arguments_are_canary_errors(cl100k: Tokenizer, minter: CanaryMinter) -> None:
    with pytest.raises(CanaryError, match="filler"):
        build_prompt(cl100k, minter, tenant=0, request=0, num_tokens=9, filler="lorem")  # type: ignore[arg-type]
    with pytest.raises(CanaryError, match="page size"):
        build_prompt(cl100k, minter, tenant=0, request=0, num_tokens=9, page_size=0)
    with pytest.raises(CanaryError, match=f"more than {NUM_INDICES} canaries"):
        build_prompt(cl100k, minter, tenant=0, request=0, num_tokens=3_000_000, page_size=13)


def test_prose_filler_reads_like_sentences_and_is_deterministic(
    cl100k: Tokenizer, minter: CanaryMinter
) -> None:
    args = {"tenant": 3, "request": 3, "num_tokens": 4000, "page_size": 64}
    prompt = build_prompt(cl100k, minter, seed=5, **args)  # type: ignore[arg-type]
    assert prompt == build_prompt(cl100k, minter, seed=5, **args)  # type: ignore[arg-type]
    assert prompt.text != build_prompt(cl100k, minter, seed=6, **args).text  # type: ignore[arg-type]
    filler = prompt.text
    for span in prompt.canaries:
        filler = filler.replace(" " + span.text, "\n")
    gaps = [gap for gap in filler.split("\n") if gap]
    assert len(gaps) >= len(prompt.canaries) - 1
    assert all(re.fullmatch(r"( [A-Z][a-z]*)( [A-Za-z]+[.,]?)*", gap) for gap in gaps)
    sentences = re.findall(r"[A-Z][A-Za-z ,]+\.", filler)
    assert len(sentences) > 100
    assert all(4 <= len(s.split()) <= 20 for s in sentences)
    words = re.findall(r"[a-z]+", filler.lower())
    function_words = sum(w in {"the", "a", "and", "that", "was", "by", "there"} for w in words)
    assert function_words / len(words) > 0.15  # English, not a word salad


class SplittingTokenizer:
    """One token per space-led word; additive at every boundary."""

    name = "splitting-test"
    vocab_size = 1000
    pattern = re.compile(r" ?[^ ]+")

    def encode(self, text: str) -> list[int]:
        return [hash(t) % 1000 for t in self.pattern.findall(text)]

    def decode(self, ids: Sequence[int]) -> str:
        raise AssertionError("the prompt builder never decodes")

    def count(self, text: str) -> int:
        return len(self.encode(text))


class MergingTokenizer(SplittingTokenizer):
    """The same, but " by ydk" is one token: a boundary that merges."""

    name = "merging-test"
    pattern = re.compile(r" by ydk| ?[^ ]+")


def test_a_merged_boundary_is_repaired_by_another_filler(minter: CanaryMinter) -> None:
    merged = 0
    for request in range(20):
        args = {"tenant": 0, "request": request, "num_tokens": 400}
        plain = build_prompt(SplittingTokenizer(), minter, **args)  # type: ignore[arg-type]
        merged += plain.text.count(" by ydk")
        repaired = build_prompt(MergingTokenizer(), minter, **args)  # type: ignore[arg-type]
        assert MergingTokenizer().count(repaired.text) == 400
        assert " by ydk" not in repaired.text
        assert [s.text for s in repaired.canaries] == [s.text for s in plain.canaries]
        for span in repaired.canaries:
            assert repaired.text[span.char_offset : span.char_offset + len(span.text)] == span.text
            head = repaired.text[: span.char_offset + len(span.text)]
            assert MergingTokenizer().count(head) == span.token_offset + 7
    assert merged > 10  # the same fillers would have merged without the repair


def test_repair_gives_up_clearly_when_nothing_helps(minter: CanaryMinter) -> None:
    class AlwaysMerging(MergingTokenizer):
        name = "always-merging"

        def encode(self, text: str) -> list[int]:
            return [hash(t) % 1000 for t in re.findall(r"[^ ]+ ydk| ?[^ ]+", text)]

    with pytest.raises(CanaryError, match="merges tokens across canary boundaries"):
        build_prompt(AlwaysMerging(), minter, tenant=0, request=0, num_tokens=200)


def test_hugging_face_tokenizer_prompts_are_exact(tmp_path: Path, minter: CanaryMinter) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "the": 1, "ydk": 2, ".": 3}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()  # "road." is two tokens here
    hf.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert minter.num_tokens(tokenizer) == 7
    for n in (1, 6, 7, 100, 2049):
        prompt = build_prompt(tokenizer, minter, tenant=1, request=n, num_tokens=n, page_size=32)
        assert tokenizer.count(prompt.text) == n
        starts = [span.token_offset for span in prompt.canaries]
        if n >= 7:
            check_every_window(starts, 7, n, 32)
            for span in prompt.canaries:
                head = prompt.text[: span.char_offset + len(span.text)]
                assert tokenizer.count(head) == span.token_offset + 7


@pytest.mark.parametrize("cpus", [1, 64])
def test_prompts_counted_chunk_by_chunk_are_the_same_prompts(
    cl100k: Tokenizer, minter: CanaryMinter, monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    # one chunk: counted inline; 97 canaries a chunk: many segments, counted in line (few
    # CPUs) or in the worker thread (many)
    args = {"tenant": 2, "request": 9, "num_tokens": 20_000, "page_size": 16}
    whole = build_prompt(cl100k, minter, **args)  # type: ignore[arg-type]
    monkeypatch.setattr(prompt_module, "_CHUNK_CANARIES", 97)
    monkeypatch.setattr(prompt_module, "_usable_cpus", lambda: cpus)
    chunked = build_prompt(cl100k, minter, **args)  # type: ignore[arg-type]
    assert chunked == whole
    check_prompt(chunked, cl100k, minter, tenant=2, request=9, page_size=16)
    none = build_prompt(cl100k, minter, **args, filler="none")  # type: ignore[arg-type]
    check_prompt(none, cl100k, minter, tenant=2, request=9, page_size=16)


class CutMergingTokenizer(SplittingTokenizer):
    """Merges a canary's last word with a capitalised word after it: the boundary between
    a canary and the filler after it, which is where chunks are cut."""

    name = "cut-merging-test"
    pattern = re.compile(r" ?(?:" + "|".join(WORDS) + r") [A-Z][a-z]+| ?[^ ]+")


def test_a_merge_across_a_chunk_cut_is_never_a_wrong_count(
    minter: CanaryMinter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prompt_module, "_CHUNK_CANARIES", 1)  # every such boundary is a cut
    args = {"tenant": 0, "request": 3, "num_tokens": 400}
    plain = build_prompt(SplittingTokenizer(), minter, **args)  # type: ignore[arg-type]
    assert CutMergingTokenizer().count(plain.text) != 400  # the same text would miscount
    # the repair swaps fillers before a canary: a capital after one is in every filler
    with pytest.raises(CanaryError, match="merges tokens across canary boundaries"):
        build_prompt(CutMergingTokenizer(), minter, **args)  # type: ignore[arg-type]

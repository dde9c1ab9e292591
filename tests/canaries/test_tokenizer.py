"""Local tokenizers: tiktoken offline, Hugging Face tokenizer.json, clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvcanary.canaries import CanaryError, Tokenizer, load_tokenizer
from kvcanary.canaries.tokenizer import _load_tiktoken


def test_cl100k_works_offline_and_is_cached(cl100k: Tokenizer) -> None:
    assert isinstance(cl100k, Tokenizer)
    assert cl100k.name == "cl100k_base"
    assert cl100k.vocab_size == 100277
    ids = cl100k.encode("Hello world")
    assert ids == [9906, 1917]
    assert cl100k.decode(ids) == "Hello world"
    assert cl100k.count("Hello world") == 2
    assert cl100k.count("<|endoftext|>") > 1  # special-token text is ordinary text here
    assert load_tokenizer("cl100k_base") is cl100k


def test_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(CanaryError, match="unknown tokenizer 'gpt-17'"):
        load_tokenizer("gpt-17")


def test_encoding_unavailable_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken

    def offline(name: str) -> object:
        raise ConnectionError(f"cannot download {name}")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(CanaryError, match="'o200k_base' is not available offline"):
        _load_tiktoken("o200k_base")


def _tiny_tokenizer_json(path: Path) -> Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "ydk": 3}
    tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    file = path / "tokenizer.json"
    tokenizer.save(str(file))
    return file


def test_hugging_face_tokenizer_json(tmp_path: Path) -> None:
    file = _tiny_tokenizer_json(tmp_path)
    tokenizer = load_tokenizer(str(file))
    assert tokenizer.name == str(file)
    assert tokenizer.vocab_size == 4
    assert tokenizer.encode("hello world ydk") == [1, 2, 3]
    assert tokenizer.count("hello mars") == 2
    assert load_tokenizer(str(tmp_path)).encode("world") == [2]  # a directory works too


def test_missing_or_broken_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(CanaryError, match="not found"):
        load_tokenizer(str(tmp_path / "nope.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(CanaryError, match="cannot load tokenizer"):
        load_tokenizer(str(broken))


def test_tokenizers_package_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = _tiny_tokenizer_json(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    load_tokenizer.cache_clear()
    try:
        with pytest.raises(CanaryError, match=r"pip install 'kvcanary\[hf\]'"):
            load_tokenizer(str(file))
    finally:
        load_tokenizer.cache_clear()

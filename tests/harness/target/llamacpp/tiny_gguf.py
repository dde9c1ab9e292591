"""A tiny llama-architecture GGUF model with random weights, for serving with llama.cpp.

Two vocabularies, both GPT-2-style byte-level BPE (llama.cpp's `gpt2` tokenizer model), each
also saved as a Hugging Face `tokenizer.json` that tokenizes exactly as the GGUF does:

- `bpe`: a BPE trained (HF `tokenizers`, deterministic) on English text that ships with
  Python (the reference manual's topics in `pydoc_data`), so common English words are one
  token after a space, as in a real model's vocabulary;
- `bytes`: the 256 byte tokens and one merge that never applies to UTF-8 text: every byte
  is a token (the coarsest vocabulary).

Both add a BOS token to every prompt (`tokenizer.ggml.add_bos_token`), as Llama models do. The
weights are random, so the text generated is noise; the server, its tokenizer, its limits and
its HTTP conventions are llama.cpp's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

Vocabulary = Literal["bpe", "bytes"]
BOS, EOS = "<|bos|>", "<|eos|>"
_N_EMBD, _N_HEAD, _N_FF, _N_LAYER = 64, 4, 128, 1
_BPE_VOCAB_SIZE = 4096


@dataclass(frozen=True, slots=True)
class TinyModel:
    gguf: Path
    tokenizer_json: Path
    vocabulary: Vocabulary


def build_tiny_model(directory: Path, vocabulary: Vocabulary, *, seed: int = 0) -> TinyModel:
    """Write `<vocabulary>.gguf` and `<vocabulary>/tokenizer.json` under `directory`."""
    tokenizer = _tokenizer(vocabulary)
    folder = directory / vocabulary
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json = folder / "tokenizer.json"
    tokenizer.save(str(tokenizer_json))
    gguf_path = directory / f"{vocabulary}.gguf"
    _write_gguf(gguf_path, tokenizer, seed)
    return TinyModel(gguf_path, tokenizer_json, vocabulary)


def _tokenizer(vocabulary: Vocabulary):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocabulary == "bytes":
        vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
        # llama.cpp refuses a BPE without merges; byte 0xFF ("ÿ") never occurs in UTF-8
        # text, so this one merge never applies and every byte stays its own token
        vocab["ÿÿ"] = len(vocab)
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("ÿ", "ÿ")]))
    else:
        tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    if vocabulary == "bpe":
        from pydoc_data.topics import topics

        trainer = trainers.BpeTrainer(
            vocab_size=_BPE_VOCAB_SIZE, initial_alphabet=alphabet, show_progress=False
        )
        tokenizer.train_from_iterator((topics[k] for k in sorted(topics)), trainer=trainer)
    tokenizer.add_special_tokens([BOS, EOS])
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bos)]
    )
    return tokenizer


def _write_gguf(path: Path, tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
    import json

    import gguf

    model = json.loads(tokenizer.to_str())["model"]
    by_id = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    special = {BOS, EOS}
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("kvcanary-tiny")
    writer.add_context_length(4096)
    writer.add_embedding_length(_N_EMBD)
    writer.add_block_count(_N_LAYER)
    writer.add_feed_forward_length(_N_FF)
    writer.add_head_count(_N_HEAD)
    writer.add_head_count_kv(_N_HEAD)
    writer.add_rope_dimension_count(_N_EMBD // _N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.token_to_id(BOS))
    writer.add_eos_token_id(tokenizer.token_to_id(EOS))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int) -> None:
        # numpy shape is (rows, cols); GGUF lists dimensions innermost first
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    n_vocab = len(tokens)
    tensor("token_embd.weight", n_vocab, _N_EMBD)
    writer.add_tensor("output_norm.weight", np.ones(_N_EMBD, dtype=np.float32))
    tensor("output.weight", n_vocab, _N_EMBD)
    for layer in range(_N_LAYER):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(_N_EMBD, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(_N_EMBD, dtype=np.float32))
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"{block}.{part}.weight", _N_EMBD, _N_EMBD)
        tensor(f"{block}.ffn_gate.weight", _N_FF, _N_EMBD)
        tensor(f"{block}.ffn_up.weight", _N_FF, _N_EMBD)
        tensor(f"{block}.ffn_down.weight", _N_EMBD, _N_FF)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

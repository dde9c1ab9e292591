"""Write a tiny random Llama model that vLLM serves: `python tiny_llama.py OUT_DIR WORDS_TXT`.

Run with the vLLM venv's python (`transformers`, `tokenizers` and `torch` are vLLM's own;
kvcanary's venv has no transformers). Nothing is downloaded:

- the tokenizer is a GPT-2-style byte-level BPE of 16k tokens, trained (deterministic) with
  `tokenizers` on kvcanary's canary word list, sentences made from it by a seeded random
  generator and English text that ships with Python (the reference manual's topics in
  `pydoc_data`), so common words are one token after a space, as in a real vocabulary;
  Llama's BOS is prepended to every prompt, and the chat template is a small one of ours;
- the model is a `LlamaForCausalLM` with random weights: hidden 128, 2 layers, 4 heads of 32
  (vLLM's CPU attention has no head size under 32), 2 KV heads (grouped-query attention, as
  real Llamas), float32 (vLLM casts it to bfloat16).

Its text is noise; what the tests use is the real engine's scheduling, caching, limits and
HTTP conventions around it.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

VOCAB_SIZE = 16384
CONTEXT_TOKENS = 4096
BOS, EOS = "<|bos|>", "<|eos|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SENTENCES = 60_000


def corpus(words: list[str], seed: int = 0) -> list[str]:
    """The training text: English prose, then seeded sentences of the words with digits and
    punctuation (so numbers and punctuation merge as they do in a real vocabulary)."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    texts = [topics[key] for key in sorted(topics)]
    for _ in range(_SENTENCES):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 99999)}"
        texts.append(" " + sentence.capitalize() + rng.choice(".!?,;:"))
    return texts


def train_tokenizer(words: list[str]):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[BOS, EOS, "<|end|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(words), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def write_model(out: Path, words: list[str]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(words),
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=CONTEXT_TOKENS,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=CONTEXT_TOKENS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    words_txt = Path(sys.argv[2]).read_text().split()
    write_model(Path(sys.argv[1]), words_txt)

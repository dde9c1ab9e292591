"""Which prompt position the recall head reads at each output step (torch-free).

Output step 0 is the token prefill samples; it quotes position 0. Decode's steps 1, 2, ... come
in excerpts of `page_size` consecutive steps, and the excerpts' pages are spread evenly from the
first page to the last. With `copy_noise` 0 each excerpt is one whole, page-aligned page of the
prompt: a quoted page reproduces exactly the tokens whose KV sits in it, and since every
page-sized window of a prompt holds a complete canary, any quoted page names its owner.

With `copy_noise` > 0 the reading wanders the way a model copying from its context does, each
choice seeded by (`salt`, excerpt, step), where the salt mixes the engine seed with the
prompt's first token:

- an excerpt may start anywhere in its page instead of on the boundary;
- a step skips a position (a dropped token) or reads the same one again (a stutter);
- a step jumps to another place in the prompt and the copy goes on from there, so runs of
  quoted text have varying lengths and often open or close in the middle of a canary;
- an excerpt runs on from where the previous one stopped instead of going to its own page
  (drift: the answer keeps quoting the context it was in, for up to `MAX_RUN_ON` excerpts).

The probabilities scale with `copy_noise`; the recall head adds content-dependent slips of its
own (`model/recall.py`). Step 0 never depends on the step count or the noise, so prefill
(which generates one token) and decode agree on the first token.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

MAX_RUN_ON = 3
"""At most this many consecutive excerpts continue the one before them."""
SKIP_RATE = 0.1
STUTTER_RATE = 0.05
JUMP_RATE = 0.25
SHIFT_RATE = 1.0
RUN_ON_RATE = 0.5
"""Per step (skip, stutter, jump) and per excerpt (shifted start, run on) probabilities at
copy_noise 1; each scales with copy_noise."""
_MASK = (1 << 64) - 1


def recall_position(
    step: int,
    num_prompt_tokens: int,
    page_size: int,
    max_new_tokens: int,
    *,
    copy_noise: float = 0.0,
    salt: int = 0,
) -> int:
    """The logical prompt position output step `step` quotes."""
    assert num_prompt_tokens >= 1
    assert step >= 0
    assert page_size >= 1
    if step == 0:
        return 0
    excerpt, offset = divmod(step - 1, page_size)
    num_excerpts = max(1, math.ceil((max_new_tokens - 1) / page_size))
    excerpt = min(excerpt, num_excerpts - 1)
    if copy_noise <= 0:
        position = _page_start(excerpt, num_prompt_tokens, page_size, num_excerpts) + offset
    else:  # a copy that runs past the end of the prompt wraps to its start
        schedule = _Noisy(copy_noise, salt, num_prompt_tokens, page_size, num_excerpts)
        return schedule.position(excerpt, offset) % num_prompt_tokens
    return min(max(position, 0), num_prompt_tokens - 1)


def _page_start(excerpt: int, num_prompt_tokens: int, page_size: int, num_excerpts: int) -> int:
    num_pages = math.ceil(num_prompt_tokens / page_size)
    return excerpt * (num_pages - 1) // max(num_excerpts - 1, 1) * page_size


@dataclass(frozen=True, slots=True)
class _Noisy:
    """The wandering schedule of one request: every choice a hash of its place, each
    excerpt's walk computed once (`_walk` is cached), so a step costs a lookup."""

    noise: float
    salt: int
    num_prompt_tokens: int
    page_size: int
    num_excerpts: int

    def position(self, excerpt: int, offset: int) -> int:
        return _walk(self, excerpt, MAX_RUN_ON)[offset]

    def start(self, excerpt: int, run_on_left: int) -> int:
        if excerpt > 0 and run_on_left > 0 and self.chance(RUN_ON_RATE, excerpt, -1):
            # run on: go on from where the previous excerpt stopped
            return _walk(self, excerpt - 1, run_on_left - 1)[self.page_size]
        start = _page_start(excerpt, self.num_prompt_tokens, self.page_size, self.num_excerpts)
        if not self.chance(SHIFT_RATE, excerpt, -2):
            return start
        return start + int(self.uniform(excerpt, -3) * self.page_size)

    def chance(self, rate: float, excerpt: int, slot: int) -> bool:
        return self.uniform(excerpt, slot) < rate * self.noise

    def uniform(self, excerpt: int, slot: int) -> float:
        return _mix(self.salt, excerpt, slot) / 2.0**64


@functools.lru_cache(maxsize=4096)
def _walk(schedule: _Noisy, excerpt: int, run_on_left: int) -> tuple[int, ...]:
    """Where the copy is at each of the excerpt's steps, and one step past its end."""
    position = schedule.start(excerpt, run_on_left)
    positions = [position]
    for j in range(1, schedule.page_size + 1):
        if schedule.chance(JUMP_RATE, excerpt, 4 * j):
            position = int(schedule.uniform(excerpt, 4 * j + 1) * schedule.num_prompt_tokens)
        elif schedule.chance(SKIP_RATE, excerpt, 4 * j + 2):
            position += 2
        elif not schedule.chance(STUTTER_RATE, excerpt, 4 * j + 3):
            position += 1
        positions.append(position)
    return tuple(positions)


def schedule_salt(seed: int, first_token: int) -> int:
    """The salt of a request's schedule: the engine seed and the prompt's first token."""
    return _mix(seed, first_token, 0)


def _mix(*values: int) -> int:
    """splitmix64 over the values: a well-spread 64-bit hash."""
    x = 0x9E3779B97F4A7C15
    for value in values:
        x = (x ^ (value & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & _MASK
        x ^= x >> 29
    return x

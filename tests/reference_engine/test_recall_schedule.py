"""The recall schedule: whole pages, spread over the prompt, step 0 fixed."""

from __future__ import annotations

from itertools import pairwise

from kvcanary.reference_engine.recall_schedule import MAX_RUN_ON, recall_position


def test_step_zero_quotes_position_zero_whatever_the_length() -> None:
    assert recall_position(0, 1, 16, 1) == 0
    assert recall_position(0, 5000, 16, 256) == 0


def test_excerpts_are_whole_pages_from_first_to_last() -> None:
    positions = [recall_position(t, 1600, 16, 1 + 4 * 16) for t in range(1, 1 + 4 * 16)]
    excerpts = [positions[i : i + 16] for i in range(0, 64, 16)]
    starts = [e[0] for e in excerpts]
    assert starts == [0, 33 * 16, 66 * 16, 99 * 16]  # pages 0, 33, 66, 99 of 100
    for excerpt in excerpts:
        assert excerpt == list(range(excerpt[0], excerpt[0] + 16))
        assert excerpt[0] % 16 == 0


def test_positions_stay_inside_the_prompt() -> None:
    for length in (1, 7, 16, 17, 333):
        for step in range(200):
            assert 0 <= recall_position(step, length, 16, 200) < length


# ---- copy_noise --------------------------------------------------------------------------


def noisy(length: int, steps: int, noise: float, salt: int = 7) -> list[int]:
    return [
        recall_position(t, length, 16, steps, copy_noise=noise, salt=salt) for t in range(steps)
    ]


def test_noisy_positions_stay_inside_the_prompt_and_step_zero_is_fixed() -> None:
    for length in (1, 7, 16, 17, 333, 3000):
        for noise in (0.1, 0.4, 1.0):
            positions = noisy(length, 200, noise)
            assert positions[0] == 0
            assert all(0 <= p < length for p in positions)


def test_noisy_schedule_is_seeded() -> None:
    assert noisy(3000, 300, 0.4) == noisy(3000, 300, 0.4)
    assert noisy(3000, 300, 0.4) != noisy(3000, 300, 0.4, salt=8)


def test_noise_drops_stutters_jumps_and_varies_run_lengths() -> None:
    positions = noisy(3000, 2000, 0.4)
    moves = [b - a for a, b in pairwise(positions[1:])]
    assert moves.count(1) > len(moves) // 2  # mostly copying on
    assert 2 in moves  # a dropped token
    assert 0 in moves  # a stutter
    assert any(abs(m) > 16 for m in moves)  # a jump elsewhere, or the next excerpt
    runs, length = [], 1
    for move in moves:
        if move == 1:
            length += 1
        else:
            runs.append(length)
            length = 1
    assert len(set(runs)) >= 5  # quoted runs of varying length
    starts = {positions[1 + 16 * e] % 16 for e in range(len(positions) // 16 - 1)}
    assert len(starts) > 4  # excerpts no longer open on page boundaries


def test_more_noise_means_fewer_plain_steps() -> None:
    def plain(noise: float) -> int:
        positions = noisy(3000, 2000, noise)
        return sum(b - a == 1 for a, b in pairwise(positions[1:]))

    assert plain(0.0) > plain(0.2) > plain(0.6) > plain(1.0)


def test_excerpts_run_on_from_where_the_last_one_stopped_for_a_while() -> None:
    """Drift: an excerpt that goes on copying where the previous one stopped instead of going
    to its own page, for at most MAX_RUN_ON excerpts in a row."""
    steps = 2000
    positions = noisy(30_000, steps, 0.4)  # excerpts' own pages 15 pages apart
    exact = noisy(30_000, steps, 0.0)
    run_on = []
    for start in range(17, steps - 16, 16):  # each excerpt's first step after the first
        own_page = exact[start]
        continues = 0 <= positions[start] - positions[start - 1] <= 2
        run_on.append(continues and not 0 <= positions[start] - own_page < 16)
    assert sum(run_on) >= 5
    longest = chain = 0
    for is_run_on in run_on:
        chain = chain + 1 if is_run_on else 0
        longest = max(longest, chain)
    assert 2 <= longest <= MAX_RUN_ON
    assert not any(  # noise 0: every excerpt opens on its own page
        0 <= exact[s] - exact[s - 1] <= 2 for s in range(17, steps - 16, 16)
    )

"""The recall schedule: whole pages, spread over the prompt, step 0 fixed."""

from __future__ import annotations

from reference_engine.recall_schedule import recall_position


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

"""EngineConfig: presets, overrides, validation, and the help text tables."""

from __future__ import annotations

import pytest

from kvcanary.reference_engine.config import FIXES, PRESETS, EngineConfig


def test_vulnerable_preset_has_the_incident_shape() -> None:
    config = EngineConfig.from_preset("vulnerable")
    assert config.fixes == frozenset()
    assert config.prefill_pool_tokens < config.context_length < config.decode_pool_tokens
    assert config.prefill_pool_tokens == pytest.approx(0.65 * config.context_length, abs=16)
    # each side's own limit: prefill's is lowered by its pool, decode's is not
    assert config.max_req_input_len(config.prefill_pool_tokens) == config.prefill_pool_tokens - 6
    assert config.max_req_input_len(config.decode_pool_tokens) == config.context_length - 6


def test_hardened_preset_has_every_fix_and_large_pools() -> None:
    config = EngineConfig.from_preset("hardened")
    assert config.fixes == frozenset(FIXES)
    assert config.prefill_pool_tokens >= 2 * config.context_length
    assert config.decode_pool_tokens >= 2 * config.context_length


def test_pools_follow_an_overridden_context_unless_given() -> None:
    config = EngineConfig.from_preset("vulnerable", context_length=1024)
    assert (config.prefill_pool_tokens, config.decode_pool_tokens) == (656, 2048)
    config = EngineConfig.from_preset("vulnerable", context_length=1024, decode_pool_tokens=4096)
    assert config.decode_pool_tokens == 4096
    assert config.preset == "vulnerable"


def test_fixes_accept_any_iterable_and_are_queried_by_name() -> None:
    config = EngineConfig(fixes=["coverage_check"])  # type: ignore[arg-type]
    assert config.has("coverage_check")
    assert not config.has("kv_checksum")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"fixes": frozenset({"no_such_fix"})}, "unknown fix"),
        ({"decode_pool_tokens": 1000}, "multiple of page_size"),
        ({"free_order": "fifo"}, "free_order"),
        ({"device": "tpu"}, "device"),
        ({"num_heads": 3, "num_kv_heads": 2}, "num_kv_heads"),
        ({"head_dim": 16}, "head_dim"),
        ({"num_layers": 1}, "num_layers"),
        ({"prefill_chunk_tokens": 0}, "prefill_chunk_tokens"),
        ({"release_timeout_s": 0.0}, "release_timeout_s"),
    ],
)
def test_invalid_configs_raise_a_clear_value_error(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)  # type: ignore[arg-type]


def test_pool_covers_context_refuses_the_vulnerable_pools() -> None:
    with pytest.raises(ValueError, match="cannot hold one context_length"):
        EngineConfig.from_preset("vulnerable", fixes=frozenset({"pool_covers_context"}))


def test_patched_preset_keeps_the_incident_pools_with_every_fix_that_can_start() -> None:
    patched = EngineConfig.from_preset("patched")
    vulnerable = EngineConfig.from_preset("vulnerable")
    assert (patched.prefill_pool_tokens, patched.decode_pool_tokens) == (
        vulnerable.prefill_pool_tokens,
        vulnerable.decode_pool_tokens,
    )
    assert patched.prefill_pool_tokens < patched.context_length
    assert patched.fixes == frozenset(FIXES) - {"pool_covers_context"}
    assert not patched.merge_prefill_usage
    small = EngineConfig.from_preset("patched", context_length=1024)
    assert small.prefill_pool_tokens == 656  # the pools follow the context, as vulnerable's


def test_unknown_preset_and_unknown_field_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        EngineConfig.from_preset("nope")
    with pytest.raises(ValueError, match="unknown engine config field"):
        EngineConfig.from_preset("vulnerable", pool=3)


def test_help_tables_describe_every_preset_and_fix() -> None:
    assert set(PRESETS) == {"vulnerable", "patched", "hardened", "race"}
    for fix, text in FIXES.items():
        assert text.strip(), fix
    assert "#38935" in FIXES["admission_retire"]
    assert "#35049" in FIXES["deferred_release"]


def test_the_race_preset_makes_decode_the_smallest_pool_and_one_write_per_prompt() -> None:
    config = EngineConfig.from_preset("race")
    assert config.context_length == 1024
    assert not config.fixes
    assert config.decode_pool_tokens == 1024 < config.prefill_pool_tokens
    assert config.transfer_chunk_pages * config.page_size >= config.prefill_chunk_tokens == 1024
    assert config.transfer_bandwidth_bytes_per_s == 65536 / 0.005  # 5 ms per default page
    assert EngineConfig.from_preset("race", context_length=2048).decode_pool_tokens == 2048

"""The `cache_probe` scenario step: parsing, the shipped scenarios, and how it is judged."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.scenarios.repro import StepReport, judge, run_repro
from kvcanary.harness.scenarios.schema import (
    CacheProbeStep,
    Expectation,
    parse_scenario,
    resolve_scenario,
)

SCENARIO = """\
name = "probe-example"
description = "A probe step."
[engine]
preset = "vulnerable"
prefix_cache = true
[[steps]]
kind = "victims"
sizes = ["0.25*context"]
[[steps]]
kind = "cache_probe"
{probe}
[expect]
outcome = "leak"
must_include = ["shared_prefix_cache"]
"""


def probe_step(text: str) -> CacheProbeStep:
    step = parse_scenario(SCENARIO.format(probe=text), "probe.toml").steps[-1]
    assert isinstance(step, CacheProbeStep)
    return step


def test_a_probe_step_reads_its_settings_with_defaults() -> None:
    assert probe_step("") == CacheProbeStep("2-cache_probe", 9)
    step = probe_step(
        'trials = 12\nprompt_tokens = 512\nsalts = true\ntenants = ["tenant-0", "tenant-2"]'
    )
    assert (step.trials, step.prompt_tokens, step.salts) == (12, 512, True)
    assert step.tenants == ("tenant-0", "tenant-2")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("trials = 2", "probe.toml:11: steps[2].trials: must be at least 5, got 2"),
        ("prefix_fraction = 1.5", "steps[2].prefix_fraction: must be between 0 and 1"),
        ("salts = 1", "steps[2].salts: expected true or false"),
        ('tenants = ["tenant-0"]', "the probe needs at least two distinct tenants"),
        ('tenants = ["nobody", "tenant-0"]', "no tenant named 'nobody'"),
        ('sizes = ["pool"]', "steps[2].sizes: unknown key"),
    ],
)
def test_a_bad_probe_step_is_one_line_naming_file_line_and_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        probe_step(text)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_shipped_scenario_and_its_control() -> None:
    leak = resolve_scenario("shared-prefix-cache", {"trials": "8"})
    control = resolve_scenario("shared-prefix-cache-control")
    assert leak.expect.must_include == ("shared_prefix_cache",)
    assert control.expect.outcome == "clean"
    for scenario, preset in ((leak, "vulnerable"), (control, "hardened")):
        assert scenario.engine is not None
        assert scenario.engine.preset == preset
        assert scenario.engine.overrides["prefix_cache"] is True
        probe = scenario.steps[-1]
        assert isinstance(probe, CacheProbeStep)
        assert probe.salts
    assert isinstance(leak.steps[-1], CacheProbeStep)
    assert leak.steps[-1].trials == 8


def test_an_unverifiable_probe_makes_a_clean_control_inconclusive() -> None:
    step = CacheProbeStep("probe", 3)
    blind = StepReport(
        2, step, num_requests=100, probe_verdict="inconclusive", probe_reasons=("cache off",)
    )
    verdict, reasons = judge(Expectation("clean"), {}, [blind], "completed")
    assert verdict == "inconclusive"
    assert reasons == ("step 2 (probe): isolation unverifiable: cache off",)
    seen = StepReport(2, step, num_requests=100, probe_verdict="clean", probe_reasons=("ok",))
    assert judge(Expectation("clean"), {}, [seen], "completed")[0] == "reproduced"


@pytest.mark.slow
def test_the_shared_cache_scenario_reproduces_on_the_bundled_engine(tmp_path: Path) -> None:
    scenario = resolve_scenario("shared-prefix-cache", {"trials": "8", "prompt_tokens": "512"})
    out = tmp_path / "out"
    result = run_repro(scenario, out=out, file=io.StringIO(), engine_processes=False)

    assert result.verdict == "reproduced", result.reasons
    assert result.findings["shared_prefix_cache"] == 4  # 2 pairs x (own salt, spoofed salt)
    probe = result.steps[-1]
    assert probe.probe_verdict == "leak"
    assert probe.findings == {"shared_prefix_cache": 4}
    rows = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows if r["type"] == "phase"] == ["1-victims", "cache_probe"]
    assert [r["type"] for r in rows][-3:] == ["probe_finished", "timing_fitted", "run_finished"]

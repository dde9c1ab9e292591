"""Run options as data, and run settings from defaults, a TOML file, a scenario and flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.run.config import (
    DEFAULT_CONCURRENCY,
    DEFAULT_ENGINE_CONCURRENCY,
    DEFAULT_NUM_REQUESTS,
    Layer,
    RunConfig,
    load_config_file,
    merge,
    resolve,
    settings,
)
from kvcanary.harness.run.option_flags import add_to_parser, given_values
from kvcanary.harness.run.option_values import format_duration, parse_duration
from kvcanary.harness.run.options import OPTIONS, OPTIONS_BY_NAME, PLUGIN_PREFIX, options_for


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("10m", 600),
        ("8h", 28800),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("45", 45),
        ("1.5h", 5400),
        ("2d", 172800),
    ],
)
def test_parse_duration_reads_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10x", "m10", "-5s", "0s", "10 m", "1h 30m", "nan"])
def test_parse_duration_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize("seconds", [0.25, 30, 90, 600, 5400, 28800])
def test_format_duration_round_trips(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)


def test_every_option_has_help_flags_and_a_parsable_default() -> None:
    names = [option.name for option in OPTIONS]
    assert len(names) == len(set(names))
    for option in OPTIONS:
        assert option.help.endswith("."), option.name
        assert option.cli_flag == "--" + option.name.replace("_", "-")
        assert option.plugin_flag == PLUGIN_PREFIX + option.name.replace("_", "-")
        if option.choices is not None:
            assert option.default in option.choices


def test_the_plugin_takes_the_run_commands_options_with_the_prefix() -> None:
    def flags(scope: str) -> set[str]:
        parser = argparse.ArgumentParser()
        prefix = PLUGIN_PREFIX if scope == "plugin" else "--"
        add_to_parser(parser, options_for(scope), prefix=prefix)  # type: ignore[arg-type]
        return {flag for action in parser._actions for flag in action.option_strings}

    # `--ray` sends from a cluster; the plugin's runs send from the pytest process
    cli = flags("run") - {"-h", "--help", "--ray"}
    plugin = flags("plugin") - {"-h", "--help"}
    plugin_own = {"--kvcanary-suite", "--kvcanary-engine"}  # the alias of ...-engine-preset
    assert plugin - plugin_own == {PLUGIN_PREFIX + flag.removeprefix("--") for flag in cli}
    assert plugin_own <= plugin
    assert not {"report_every", "rotate_every", "force"} & {o.name for o in options_for("plugin")}


def test_every_command_takes_its_shared_options_from_the_registry() -> None:
    def scope(name: str) -> dict[str, object]:
        return {option.name: option for option in options_for(name)}  # type: ignore[arg-type]

    audit, repro, run = scope("audit"), scope("repro"), scope("run")
    assert {"target", "model", "api_key_env", "timeout", "prefill", "probe"} <= set(audit)
    assert {"target", "out", "api_key_env", "keep_raw_evidence", "param"} <= set(repro)
    assert audit["target"].parse is run["target"].parse  # type: ignore[attr-defined]
    assert audit["timeout"].default == 30.0  # type: ignore[attr-defined]
    assert run["timeout"].default == 120.0  # type: ignore[attr-defined]
    plugin_engine = scope("plugin")["engine_preset"]
    assert plugin_engine.default is None  # type: ignore[attr-defined]
    assert plugin_engine.aliases == ("engine",)  # type: ignore[attr-defined]


def _parse(argv: list[str], scope: str = "run") -> dict[str, object]:
    parser = argparse.ArgumentParser()
    options = options_for(scope)  # type: ignore[arg-type]
    add_to_parser(parser, options)
    return given_values(parser.parse_args(argv), options)


def test_parser_reports_only_flags_given() -> None:
    given = _parse(
        [
            "--tenants",
            "3",
            "--duration",
            "2m",
            "--engine-fix",
            "page_tags",
            "--engine-fix",
            "kv_checksum",
            "--keep-raw-evidence",
        ]
    )
    assert given == {
        "tenants": 3,
        "duration": 120.0,
        "engine_fix": ("page_tags", "kv_checksum"),
        "keep_raw_evidence": True,
    }


def test_parser_rejects_a_bad_value_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--tenants", "zero"])
    assert exit_info.value.code == 2
    assert "--tenants" in capsys.readouterr().err


def test_prefixed_flags_for_the_plugin() -> None:
    parser = argparse.ArgumentParser()
    add_to_parser(parser, options_for("plugin"), prefix=PLUGIN_PREFIX)
    namespace = parser.parse_args(["--kvcanary-target", "http://x:1/", "--kvcanary-rate", "2"])
    assert given_values(namespace, options_for("plugin")) == {"target": "http://x:1", "rate": 2.0}


def test_defaults_give_a_closed_loop_request_budget() -> None:
    config = resolve("run", {})
    assert config.num_requests == DEFAULT_NUM_REQUESTS
    assert config.num_workers == DEFAULT_ENGINE_CONCURRENCY  # no --target: the bundled engine
    assert resolve("run", {"target": "http://x:1"}).num_workers == DEFAULT_CONCURRENCY
    assert config.page_size is None
    timed = resolve("run", {"duration": 30.0, "rate": 5.0})
    assert timed.num_requests is None
    assert timed.num_workers is None


def test_requests_and_duration_together_are_a_usage_error() -> None:
    with pytest.raises(ConfigError, match=r"requests.*duration"):
        resolve("run", {"requests": 10, "duration": 5.0})
    with pytest.raises(ConfigError, match=r"concurrency.*rate"):
        resolve("run", {"concurrency": 2, "rate": 1.0})


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvcanary.toml"
    path.write_text(text)
    return path


def test_flags_override_the_file_and_the_file_overrides_defaults(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        [run]
        tenants = 6
        requests = 40
        concurrency = 3
        duration = "10m"  # a second bound in the same table is an error below
    """,
    )
    with pytest.raises(ConfigError, match="requests and duration"):
        resolve("run", {}, path)
    path = _write(
        tmp_path,
        """
        [run]
        tenants = 6
        requests = 40
        concurrency = 3
        pool-tokens = 4096
        engine-fix = ["page_tags"]
        keep-raw-evidence = true
    """,
    )
    config = resolve("run", {"tenants": 2, "duration": 60.0}, path)
    assert config.tenants == 2  # flag wins
    assert config.duration == 60.0
    assert config.requests is None  # the flag's --duration replaces the file's requests
    assert config.concurrency == 3
    assert config.pool_tokens == 4096
    assert config.engine_fix == ("page_tags",)
    assert config.keep_raw_evidence is True


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[run]\nbogus = 1\n", "unknown key `bogus` in \\[run\\]"),
        ("[run]\npool_tokens = 1\n", "unknown key `pool_tokens`"),
        ("[run]\nconfig = 'x.toml'\n", "unknown key `config`"),
        ("[run]\ntenants = 'many'\n", "\\[run\\] tenants: expected a positive integer"),
        ("[run]\ntenants = true\n", "\\[run\\] tenants"),
        ("[run]\nduration = '5 parsecs'\n", "\\[run\\] duration: not a duration"),
        ("[run]\napi = 'grpc'\n", "\\[run\\] api: expected one of chat, completions"),
        ("[run]\nreport-every = '1m'\n", "report-every.*only to kvcanary soak"),
        ("[runs]\ntenants = 2\n", "unknown table \\[runs\\]"),
        ("run = 3\n", "must be a table"),
        ("[run\ntenants = 2\n", "not valid TOML"),
    ],
)
def test_bad_config_files_name_the_problem(tmp_path: Path, body: str, message: str) -> None:
    path = _write(tmp_path, body)
    with pytest.raises(ConfigError, match=message) as error:
        load_config_file(path, "run")
    assert str(path) in str(error.value)


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        resolve("run", {}, tmp_path / "absent.toml")


def test_soak_table_applies_to_soak_only(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        [run]
        target = "http://127.0.0.1:9"
        concurrency = 4
        [soak]
        duration = "8h"
        report-every = "15m"
        rate = 2.5
    """,
    )
    soak = resolve("soak", {}, path)
    assert soak.duration == 8 * 3600
    assert soak.report_every == 900
    assert soak.rate == 2.5
    assert soak.concurrency is None  # [soak] rate replaces [run] concurrency
    run = resolve("run", {}, path)
    assert run.num_requests == DEFAULT_NUM_REQUESTS
    assert run.concurrency == 4


def test_a_soak_reads_a_shared_run_table_without_its_run_only_keys(tmp_path: Path) -> None:
    # one file for both commands: `requests` bounds `run`; a soak is bounded by its duration
    path = _write(tmp_path, '[run]\nrequests = 40\ntenants = 3\n[soak]\nduration = "1h"\n')
    soak = resolve("soak", {}, path)
    assert (soak.tenants, soak.duration, soak.requests) == (3, 3600, None)
    assert resolve("run", {}, path).requests == 40


def test_precedence_is_defaults_then_file_then_scenario_then_flags(tmp_path: Path) -> None:
    path = _write(tmp_path, "[run]\ntenants = 3\nseed = 1\nmodel = 'file'\nrequests = 9\n")
    scenario = Layer("scenario s.toml", {"seed": 2, "model": "scenario", "duration": 30.0})
    config = resolve("run", {"model": "flag"}, path, scenario=scenario)
    assert config.timeout == 120.0  # the default: nobody gave it
    assert config.tenants == 3  # the file over the default
    assert config.seed == 2  # the scenario over the file
    assert config.model == "flag"  # the flags over the scenario
    assert (config.requests, config.duration) == (None, 30.0)  # the scenario's side of the pair
    flags = resolve("run", {"requests": 4}, path, scenario=scenario)
    assert (flags.requests, flags.duration) == (4, None)


def test_merge_replaces_exclusive_pairs_and_none_unsets() -> None:
    low = Layer("low", {"requests": 5, "rate": 2.0, "tenants": 3})
    assert merge(low, Layer("high", {"duration": 9.0})) == {
        "duration": 9.0,
        "rate": 2.0,
        "tenants": 3,
    }
    assert merge(low, Layer("high", {"requests": None, "duration": 9.0}))["duration"] == 9.0
    assert "requests" not in merge(low, Layer("high", {"duration": 9.0}))
    with pytest.raises(ConfigError, match="high gives both concurrency and rate"):
        merge(low, Layer("high", {"concurrency": 1, "rate": 1.0}))
    filled = settings("audit", Layer("the command line", {"target": "http://x"}))
    assert filled["target"] == "http://x"
    assert filled["timeout"] == 30.0  # the audit's own default
    assert filled["prefill"] == ()


def test_soak_needs_a_duration() -> None:
    with pytest.raises(ConfigError, match="soak needs --duration"):
        resolve("soak", {})
    assert resolve("soak", {"duration": 10.0}).num_requests is None


def test_other_invariants() -> None:
    with pytest.raises(ConfigError, match="at least 2"):
        RunConfig(tenants=1)
    with pytest.raises(ConfigError, match="only without --target"):
        RunConfig(target="http://127.0.0.1:1", engine_fix=("page_tags",))
    record = RunConfig(api_key_env="MY_KEY").to_record()
    assert record["api_key_env"] == "MY_KEY"
    assert record["command"] == "run"


def test_the_profile_help_names_every_profile() -> None:
    from kvcanary.tenants.workload import profile_names

    help_text = next(o.help for o in OPTIONS if o.name == "profile")
    for name in profile_names():
        assert name in help_text


def test_the_registrys_bounds_are_the_ones_the_code_has() -> None:
    """Written out in `option_values` (the plugin imports the registry at start-up, without
    numpy), so checked here against where each comes from."""
    from kvcanary.canaries.mint import NUM_REQUESTS, NUM_TENANTS
    from kvcanary.harness.run.option_values import MAX_REQUESTS, MAX_TENANTS
    from kvcanary.harness.target.health_route import HEALTH_TIMEOUT_S

    assert (MAX_TENANTS, MAX_REQUESTS) == (NUM_TENANTS, NUM_REQUESTS)
    assert OPTIONS_BY_NAME["health_timeout"].default == HEALTH_TIMEOUT_S


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--rate", "1e-300", "expected a number from 0.001 to 100000"),
        ("--tenants", "100000000000", "expected a whole number from 1 to 256"),
        ("--concurrency", "5000", "expected a whole number from 1 to 4,096"),
        ("--seed", "1" * 40, "expected an integer >= 0"),
        ("--target", "http://user:hunter2pw@host", "carries credentials"),
        ("--target", "http://127.0.0.1:99999", "a port of 1-65535"),
        ("--health-timeout", "0s", "a duration must be positive"),
    ],
)
def test_flag_values_past_their_bounds_are_refused_while_parsed(
    flag: str, value: str, message: str
) -> None:
    option = OPTIONS_BY_NAME[flag.removeprefix("--").replace("-", "_")]
    with pytest.raises(ValueError, match=message) as refused:
        option.coerce(value)
    assert "hunter2pw" not in str(refused.value)

"""Scenario files: the shipped ones load, malformed ones fail on one line naming file:line and
field (every problem of a file at once, in file order), parameters substitute with their
types, and `kvcanary scenarios` lists what ships."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.cli import main
from kvcanary.harness.record.finding import FindingKind
from kvcanary.harness.scenarios import shipped_file, shipped_names
from kvcanary.harness.scenarios.schema import (
    SendStep,
    WaitStep,
    load_scenario,
    parse_param_assignment,
    parse_scenario,
    resolve_scenario,
)

SHIPPED = ("glm53-incident", "glm53-incident-target", "hardened-control", "mid-transfer-abort",
           "patched-control", "sglang-30233")  # fmt: skip

VALID = """\
name = "example"
description = "a scenario used by the schema tests"
references = ["https://github.com/sgl-project/sglang/issues/30233"]

[params]
victim_size = "0.5*limit"
num_probes = { default = 2, help = "probes to send" }

[engine]
preset = "vulnerable"
fixes = ["page_tags"]
context_length = 1024

[limits]
pool_tokens = "discover"
context_tokens = 1024

[tenants]
names = ["alice", "bob"]
api_key_env = { alice = "ALICE_KEY" }

[[steps]]
kind = "victims"
sizes = ["${victim_size}", "limit-1"]
count = 3
tenants = ["alice"]

[[steps]]
kind = "wait"
seconds = 0.5

[[steps]]
kind = "probes"
name = "over"
sizes = ["pool+1"]
count = "${num_probes}"

[[steps]]
kind = "disconnect"
size = "0.5*limit"
after_chunks = 0

[expect]
outcome = "leak"
must_include = ["cross_tenant_canary"]
must_not_include = ["fast_prefill"]
"""


def error_of(text: str, source: str = "bad.toml", **params: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_scenario(text, source, params)
    message = str(caught.value)
    assert "\n" not in message
    return message


def line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if fragment in line)


# -- shipped scenarios -----------------------------------------------------------------


def test_the_shipped_scenarios_load_and_are_named_after_their_files() -> None:
    assert set(SHIPPED) <= set(shipped_names())
    for name in shipped_names():
        scenario = resolve_scenario(name)
        assert scenario.name == name
        assert scenario.summary
        assert scenario.references
        assert scenario.send_steps
        file = shipped_file(name)
        assert file is not None
        assert file.read_text().startswith("# kvcanary scenario"), "each file explains itself"


def test_shipped_expectations() -> None:
    control = resolve_scenario("hardened-control")
    assert control.expect.outcome == "clean"
    assert control.engine is not None
    assert control.engine.preset == "hardened"
    incident = resolve_scenario("glm53-incident")
    assert incident.expect.outcome == "leak"
    assert FindingKind.CROSS_TENANT_CANARY in incident.expect.must_include
    assert incident.engine is not None
    assert incident.engine.preset == "vulnerable"
    abort = resolve_scenario("mid-transfer-abort")
    assert [s.kind for s in abort.steps][:2] == ["disconnect", "victims"]
    assert FindingKind.UNSAFE_ACCEPT in abort.expect.must_not_include
    assert resolve_scenario("glm53-incident-target").engine is None


# -- a valid file ----------------------------------------------------------------------


def test_a_valid_file_is_read_with_defaults_substituted() -> None:
    scenario = parse_scenario(VALID, "example.toml")
    victims, wait, probes, drop = scenario.steps
    assert isinstance(victims, SendStep)
    assert isinstance(wait, WaitStep)
    assert [s.expr for s in victims.sizes] == ["0.5*limit", "limit-1"]
    assert victims.line == line_of(VALID, "[[steps]]")
    assert (victims.name, wait.name, probes.name, drop.name) == (
        "1-victims", "2-wait", "over", "4-disconnect",
    )  # fmt: skip
    assert isinstance(probes, SendStep)
    assert probes.count == 2
    assert probes.max_tokens == 64
    assert isinstance(drop, SendStep)
    assert drop.after_chunks == 0
    assert drop.intent == "abort"
    assert scenario.limits.pool_tokens is None
    assert scenario.limits.context_tokens == 1024
    tenants = scenario.tenants.build()
    assert [(t.name, t.api_key_env) for t in tenants] == [("alice", "ALICE_KEY"), ("bob", None)]
    shared = scenario.tenants.build("SHARED_KEY")
    assert {t.api_key_env for t in shared} == {"SHARED_KEY"}
    assert scenario.engine is not None
    assert scenario.engine.fixes == ("page_tags",)
    assert dict(scenario.engine.overrides) == {"context_length": 1024}


def test_params_override_defaults_and_keep_their_types() -> None:
    scenario = parse_scenario(VALID, "example.toml", {"num_probes": "5", "victim_size": "300"})
    probes = scenario.steps[2]
    assert isinstance(probes, SendStep)
    assert probes.count == 5
    victims = scenario.steps[0]
    assert isinstance(victims, SendStep)
    assert victims.sizes[0].expr == "300"
    assert scenario.param_values["num_probes"] == 5


def test_a_text_parameter_can_become_a_number_where_one_is_expected() -> None:
    target = resolve_scenario("glm53-incident-target", {"pool_tokens": "284928"})
    assert target.limits.pool_tokens == 284928
    assert target.limits.context_tokens is None  # still "discover"
    assert resolve_scenario("glm53-incident-target").limits.pool_tokens is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"num_probes": "two"}, "--param num_probes=two: expected an integer"),
        ({"num_probes": "2.5"}, "expected an integer"),
        ({"nope": "1"}, "--param nope: example.toml declares no such parameter"),
    ],
)
def test_bad_param_overrides(params: dict[str, str], message: str) -> None:
    assert message in error_of(VALID, "example.toml", **params)


def test_a_param_value_that_breaks_a_field_names_the_field() -> None:
    message = error_of(VALID, "example.toml", victim_size="pool+")
    assert message.startswith(f"example.toml:{line_of(VALID, 'victim_size}')}: steps[1].sizes[1]:")
    target = "glm53-incident-target"
    with pytest.raises(ConfigError, match=r"limits\.pool_tokens: expected a positive number"):
        resolve_scenario(target, {"pool_tokens": "-3"})


def test_param_assignments_from_the_command_line() -> None:
    assert parse_param_assignment("pool_tokens=284928") == ("pool_tokens", "284928")
    assert parse_param_assignment(" model = glm-5.3 ") == ("model", "glm-5.3")
    with pytest.raises(ConfigError, match="expected NAME=VALUE"):
        parse_param_assignment("pool_tokens")


# -- malformed files: one line, FILE:LINE: FIELD: problem ------------------------------


def replaced(old: str, new: str) -> str:
    assert old in VALID
    return VALID.replace(old, new, 1)


@pytest.mark.parametrize(
    ("text", "fragment", "field", "problem"),
    [
        (replaced("seconds = 0.5", "seconds = 0.5\nsecs = 1"), "secs = 1", "steps[2].secs",
         "unknown key"),
        (replaced("references", "refs = []\nreferences"), "refs = []", "refs", "unknown key"),
        (replaced("context_tokens = 1024", "context_tokens = 1024\nctx = 3"), "ctx = 3",
         "limits.ctx", "unknown key"),
        (replaced("count = 3", 'count = "three"'), 'count = "three"', "steps[1].count",
         "expected an integer, got a string"),
        (replaced("seconds = 0.5", "seconds = true"), "seconds = true", "steps[2].seconds",
         "expected a number of seconds, got a boolean"),
        (replaced('name = "example"', "name = 7"), "name = 7", "name", "expected a string"),
        (replaced('sizes = ["pool+1"]', 'sizes = ["pool+"]'), 'sizes = ["pool+"]',
         "steps[3].sizes[1]", "not valid arithmetic"),
        (replaced('sizes = ["pool+1"]', 'sizes = ["pool*budget"]'), "pool*budget",
         "steps[3].sizes[1]", "unknown name 'budget'"),
        (replaced('\nsize = "0.5*limit"', '\nsize = "0.5*limit; import os"'), "import os",
         "steps[4].size", "not valid arithmetic"),
        (replaced('outcome = "leak"', 'outcome = "maybe"'), 'outcome = "maybe"',
         "expect.outcome", "expected \"leak\" or \"clean\""),
        (replaced('outcome = "leak"\n', ""), "[expect]", "expect", "missing `outcome`"),
        (VALID[: VALID.index("[expect]")], 'name = "example"', "expect", "missing"),
        (replaced('["cross_tenant_canary"]', '["cross_tenant"]'), "must_include = ",
         "expect.must_include[1]", "unknown finding kind 'cross_tenant'"),
        (replaced('outcome = "leak"', 'outcome = "clean"'), "must_include = ",
         "expect.must_include", "a clean outcome allows no finding"),
        (replaced("context_length = 1024", "context_lenght = 1024"), "context_lenght",
         "engine.context_lenght", "not an engine setting"),
        (replaced("context_length = 1024", 'context_length = "big"'), "context_length",
         "engine.context_length", "expected int"),
        (replaced('fixes = ["page_tags"]', 'fixes = ["nope"]'), "fixes = ", "engine.fixes[1]",
         "unknown fix 'nope'"),
        (replaced("context_length = 1024", "context_length = 20"), "context_length",
         "engine.context_length", "at least two pages"),
        (replaced('preset = "vulnerable"', 'preset = "safe"'), "preset = ", "engine.preset",
         "choose one of"),
        (replaced('tenants = ["alice"]', 'tenants = ["carol"]'), 'tenants = ["carol"]',
         "steps[1].tenants[1]", "no tenant named 'carol'"),
        (replaced("after_chunks = 0", "after_chunks = 0\nafter_seconds = 1"),
         line_of(VALID, 'kind = "disconnect"') - 1, "steps[4]",
         "`after_chunks` or `after_seconds`"),
        (replaced('kind = "wait"', 'kind = "sleep"'), 'kind = "sleep"', "steps[2].kind",
         "expected victims, probes, disconnect, wait or cache_probe"),
        (replaced('"${victim_size}"', '"${victim}"'), "${victim}", "steps[1].sizes[1]",
         "${victim} is not a declared parameter"),
        (replaced('names = ["alice", "bob"]', 'names = ["alice"]'), "[tenants]", "tenants",
         "at least two tenants"),
        (replaced('{ alice = "ALICE_KEY" }', '{ alice = "sk-123 456" }'), "api_key_env",
         "tenants.api_key_env.alice", "NAME of an environment variable"),
        (replaced('pool_tokens = "discover"', "pool_tokens = 0"), "pool_tokens = 0",
         "limits.pool_tokens", "expected a positive number of tokens"),
        (replaced("references", 'target = "http://x"\nreferences'), "[engine]", "engine",
         "`target` or an [engine] table"),
    ],
)  # fmt: skip
def test_a_malformed_file_names_the_line_and_the_field(
    text: str, fragment: str | int, field: str, problem: str
) -> None:
    message = error_of(text)
    line = fragment if isinstance(fragment, int) else line_of(text, fragment)
    assert message.startswith(f"bad.toml:{line}: {field}: "), message
    assert problem in message


def test_invalid_toml_reports_the_parsers_line() -> None:
    text = replaced("count = 3", "count = = 3")
    assert error_of(text).startswith(f"bad.toml:{line_of(text, 'count = = 3')}: not valid TOML")


def test_a_file_nested_5000_deep_is_a_one_line_error() -> None:
    assert error_of("x = " + "[" * 5000 + "]" * 5000 + "\n") == (
        "bad.toml: nested too deeply to be a scenario"
    )


def test_keys_inside_multiline_strings_and_arrays_are_not_taken_for_keys() -> None:
    text = replaced(
        'description = "a scenario used by the schema tests"',
        'description = """\nsteps = 3\ncount = "x"\n"""',
    ).replace('sizes = ["pool+1"]', 'sizes = [\n  "pool+1",\n  "pool+",\n]')
    message = error_of(text)
    line = text.splitlines().index("sizes = [") + 1
    assert message.startswith(f"bad.toml:{line}: steps[3].sizes[2]: ")


def test_load_scenario_reads_a_file_and_names_it(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(replaced("count = 3", "count = 0"))
    with pytest.raises(ConfigError, match=re.escape(f"{path}:{line_of(VALID, 'count = 3')}:")):
        load_scenario(path)
    with pytest.raises(ConfigError, match="not found"):
        load_scenario(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="neither a shipped one"):
        resolve_scenario("no-such-scenario")
    path.write_text(VALID)
    assert resolve_scenario(str(path)).name == "example"


# -- the CLI ---------------------------------------------------------------------------


def test_repro_of_a_malformed_file_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    text = replaced('sizes = ["pool+1"]', 'sizes = ["pool++"]')
    path.write_text(text)
    assert main(["repro", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith(f"kvcanary: error: {path}:{line_of(text, 'pool++')}: steps[3].sizes[1]:")
    assert not (tmp_path / "out").exists()


def test_repro_rejects_an_unknown_param(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["repro", "glm53-incident", "--param", "pool_tokens=1"]) == 2
    assert "declares no such parameter (it has: none)" in capsys.readouterr().err


def test_scenarios_lists_every_shipped_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scenarios"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:] if line[:1].isalnum()}
    assert set(shipped_names()) <= set(rows)
    assert rows["hardened-control"] == "clean"
    assert rows["patched-control"] == "clean"
    assert rows["glm53-incident"] == "leak"
    assert "params: pool_tokens=discover context_tokens=discover" in out


# -- every problem at once, in file order ----------------------------------------------

MISTAKES = (
    replaced('name = "example"', 'name = "Example"')
    .replace("count = 3", 'count = "three"')
    .replace('sizes = ["pool+1"]', 'sizes = ["pool+", "limit*"]')
    .replace('outcome = "leak"', 'outcome = "maybe"')
)


def test_every_problem_of_a_file_is_reported_at_once_in_file_order() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_scenario(MISTAKES, "bad.toml")
    lines = str(caught.value).splitlines()
    assert lines[0] == "bad.toml: 5 problems"
    expected = [
        (line_of(MISTAKES, 'name = "Example"'), "name: 'Example': use lowercase"),
        (line_of(MISTAKES, 'count = "three"'), "steps[1].count: expected an integer"),
        (line_of(MISTAKES, '"pool+", "limit*"'), "steps[3].sizes[1]: size expression 'pool+'"),
        (line_of(MISTAKES, '"pool+", "limit*"'), "steps[3].sizes[2]: size expression 'limit*'"),
        (line_of(MISTAKES, 'outcome = "maybe"'), "expect.outcome: 'maybe': expected"),
    ]
    assert len(lines) == 1 + len(expected)
    for text, (line, start) in zip(lines[1:], expected, strict=True):
        assert text.startswith(f"bad.toml:{line}: {start}"), text


@pytest.mark.parametrize(
    ("text", "only"),
    [
        # a wrong [tenants] table: the steps naming its tenants are not blamed too
        (replaced('names = ["alice", "bob"]', 'names = ["alice"]'), "tenants: a cross-tenant"),
        # a parameter declared wrongly: the places that use it are not blamed too
        (replaced('victim_size = "0.5*limit"', "victim_size = []"), "params.victim_size: a def"),
    ],
)
def test_a_problem_is_reported_once_not_again_where_it_is_used(text: str, only: str) -> None:
    message = error_of(text)
    assert message.split(": ", 1)[1].startswith(only), message


def test_repro_prints_every_problem_of_a_file_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(MISTAKES)
    assert main(["repro", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"kvcanary: error: {path}: 5 problems"
    assert [line.split(": ")[1] for line in err[1:]] == [
        "name", "steps[1].count", "steps[3].sizes[1]", "steps[3].sizes[2]", "expect.outcome"
    ]  # fmt: skip
    assert not (tmp_path / "out").exists()

"""The pytest plugin as a black box, without an engine: options, usage errors, skips, fixtures.

Every test runs pytest on a small project written by `pytester` (in-process unless the
test is about process start-up), with the plugin loaded from its `pytest11` entry point as
a user's pytest would load it.
"""

from __future__ import annotations

import http.server
import importlib
import re
import socket
import subprocess
import sys
import textwrap
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest

from kvcanary.harness.run.options import OPTIONS_BY_NAME

# In-process pytest runs forget the modules they imported when they end (pytester restores
# sys.modules), while numpy refuses a second import in one process and httpx keeps a map
# of the first httpcore's exception classes: what the plugin imports lazily is imported
# once here, so every run reuses the same modules.
PRELOADED = [
    importlib.import_module(name)
    for name in ("kvcanary.harness.plugin.suite", "kvcanary.harness.run.session",
                 "kvcanary.reports.render", "httpcore._backends.anyio")
]  # fmt: skip

pytest_plugins = ["pytester"]

NUM_CHECKS = 9
INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
{extra}
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """pytest in-process; the plugin's package is already imported here, which pytest
    would warn about (it cannot rewrite asserts in it), so that one warning is silenced."""
    return pytester.runpytest("-W", "ignore::pytest.PytestAssertRewriteWarning", *args)


def project(pytester: pytest.Pytester, ini: str = "", **files: str) -> None:
    pytester.makeini(INI.format(extra=ini))
    if files:
        pytester.makepyfile(**{name: textwrap.dedent(body) for name, body in files.items()})


def closed_port_url() -> str:
    """A loopback URL nothing listens on: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_help_shows_one_kvcanary_group_with_the_shared_options(pytester: pytest.Pytester) -> None:
    project(pytester)
    result = run(pytester, "--help")
    assert result.ret == 0
    text = result.stdout.str()
    group = text[text.index("kvcanary: cross-tenant KV-cache leak checks:") :]
    group = group[: group.index("\n\n")]
    for flag in (
        "--kvcanary-target=", "--kvcanary-engine=", "--kvcanary-engine-fix=",
        "--kvcanary-suite", "--kvcanary-model=", "--kvcanary-api=", "--kvcanary-tenants=",
        "--kvcanary-pool-tokens=", "--kvcanary-context-tokens=", "--kvcanary-page-size=",
        "--kvcanary-tokenizer=", "--kvcanary-requests=", "--kvcanary-duration=",
        "--kvcanary-concurrency=", "--kvcanary-seed=", "--kvcanary-out=", "--kvcanary-config=",
    ):  # fmt: skip
        assert flag in group, flag
    # the CLI's help text, defaults included, comes from the same definitions
    tenants = OPTIONS_BY_NAME["tenants"]
    assert f"{tenants.help} Default: {tenants.default}." in " ".join(group.split())
    assert "kvcanary_target (string)" in text  # the ini equivalent


def test_the_plugins_flags_are_the_run_commands_with_the_prefix(pytester: pytest.Pytester) -> None:
    from kvcanary.harness.cli import build_parser

    project(pytester)
    text = run(pytester, "--help").stdout.str()
    group = text[text.index("kvcanary: cross-tenant KV-cache leak checks:") :]
    group = group[: group.index("\n\n")]
    plugin = set(re.findall(r"(?<![\w-])--kvcanary-[a-z-]+[a-z]", group))
    subcommands = next(a for a in build_parser()._actions if a.dest == "command")
    run_parser = subcommands.choices["run"]  # type: ignore[index]
    cli = {flag for action in run_parser._actions for flag in action.option_strings}
    # `--ray` sends from a cluster; the plugin's runs send from the pytest process
    expected = {"--kvcanary-" + flag[2:] for flag in cli - {"-h", "--help", "--ray"}}
    assert plugin == expected | {"--kvcanary-suite", "--kvcanary-engine"}
    assert "--kvcanary-engine-preset" in plugin  # `--kvcanary-engine` is its alias


LAYERS_TEST = """
def test_layers(kvcanary_target, kvcanary_tenants):
    config = kvcanary_target.config
    assert len(kvcanary_tenants) == config.tenants == {tenants}
    assert config.seed == 7
    assert (config.requests, config.duration) == (4, None)
"""


def test_settings_merge_file_then_ini_then_command_line(
    pytester: pytest.Pytester, no_models_url: str
) -> None:
    pytester.makefile(".toml", kv="[run]\ntenants = 5\nseed = 7\nduration = '1m'\n")
    ini = f"kvcanary_target = {no_models_url}\nkvcanary_config = kv.toml\n"
    project(pytester, ini=ini + "kvcanary_tenants = 3\nkvcanary_requests = 4")
    # tenants: file 5 < ini 3 < command line 2; the ini's requests drops the file's duration
    for args, tenants in (((), 3), (("--kvcanary-tenants=2",), 2)):
        pytester.makepyfile(test_layers=LAYERS_TEST.format(tenants=tenants))
        run(pytester, *args).assert_outcomes(passed=1)


def test_one_source_giving_both_sides_of_a_pair_is_a_usage_error(
    pytester: pytest.Pytester,
) -> None:
    project(
        pytester,
        ini="kvcanary_requests = 4\nkvcanary_duration = 1m",
        test_a="def test_a(): pass",
    )
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "the ini file gives both requests and duration" in result.stderr.str()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kvcanary-tenants=zero"], "argument --kvcanary-tenants: expected a positive integer"),
        (
            ["--kvcanary-engine=leaky"],
            "argument --kvcanary-engine: expected one of vulnerable, patched, hardened",
        ),
        (
            ["--kvcanary-engine-preset=leaky"],
            "argument --kvcanary-engine-preset: expected one of vulnerable, patched, hardened",
        ),
        (["--kvcanary-engine-fix=page_tags"], "--kvcanary-engine-fix needs --kvcanary-engine"),
        (["--kvcanary-engine=vulnerable", "--kvcanary-engine-fix=bogus"], "unknown fix bogus"),
        (["--kvcanary-engine=hardened", "--kvcanary-target=http://x"], "not both"),
        (["--kvcanary-tenants=1"], "--tenants must be at least 2"),
    ],
)
def test_unusable_settings_are_one_line_usage_errors(
    pytester: pytest.Pytester, args: list[str], message: str
) -> None:
    project(pytester, test_a="def test_a(): pass")
    result = run(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()
    assert "Traceback" not in result.stderr.str()


@pytest.mark.parametrize(
    ("ini", "message"),
    [
        (
            "kvcanary_requests = many",
            "kvcanary: ini kvcanary_requests: expected a positive integer",
        ),
        ("kvcanary_engine = leaky", "kvcanary: ini kvcanary_engine: expected one of vulnerable"),
    ],
)
def test_a_bad_ini_value_names_the_ini_key(
    pytester: pytest.Pytester, ini: str, message: str
) -> None:
    project(pytester, ini=ini, test_a="def test_a(): pass")
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()


def test_without_a_target_the_suite_and_marked_tests_skip_with_the_reason(
    pytester: pytest.Pytester,
) -> None:
    project(
        pytester,
        test_user="""
            import pytest

            @pytest.mark.kvcanary
            def test_marked():
                raise AssertionError("must not run without a target")

            def test_run(kvcanary_run):
                raise AssertionError("must not run without a target")
        """,
    )
    result = run(pytester, "--kvcanary-suite", "-rs")
    result.assert_outcomes(skipped=NUM_CHECKS + 2)
    result.stdout.fnmatch_lines(
        ["SKIPPED [[]*] *kvcanary: no target configured; pass --kvcanary-target=URL or "
         "--kvcanary-engine=vulnerable|hardened*"]
    )  # fmt: skip
    result.stdout.fnmatch_lines(["kvcanary ssssssss*"])  # the suite's node id


def test_the_suite_is_only_collected_when_asked_for(pytester: pytest.Pytester) -> None:
    project(pytester, test_a="def test_a(): pass")
    run(pytester).assert_outcomes(passed=1)
    result = run(pytester, "--kvcanary-suite", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["test_a.py::test_a", "kvcanary::test_1_over_pool_prompts_*"])
    assert "8 tests collected" not in result.stdout.str()
    assert f"{NUM_CHECKS + 1} tests collected" in result.stdout.str()


def test_tenants_and_canaries_need_no_target(pytester: pytest.Pytester) -> None:
    project(
        pytester,
        test_canaries="""
            def test_prompt_of_exact_length(kvcanary_tenants, kvcanary_canaries):
                assert [t.name for t in kvcanary_tenants] == ["tenant-0", "tenant-1", "tenant-2"]
                prompt = kvcanary_canaries.prompt(300, tenant=2)
                assert kvcanary_canaries.tokenizer.count(prompt.text) == 300
                owners = kvcanary_canaries.owners("echo:" + prompt.canaries[3].text)
                assert {owner.tenant for owner in owners} == {"tenant-2"}
                other = kvcanary_canaries.prompt(300, tenant=0)
                assert not kvcanary_canaries.owners(other.text) & owners
        """,
    )
    run(pytester, "--kvcanary-tenants=3", "--kvcanary-seed=5").assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--kvcanary-api-key-env=KVCANARY_TEST_UNSET_KEY"],
            "ERROR: kvcanary: tenant 'tenant-0': environment variable KVCANARY_TEST_UNSET_KEY "
            "is not set or empty",
        ),
        (
            [],
            "ERROR: kvcanary: cannot reach the target at {url} (unreachable: *); "
            "check --kvcanary-target",
        ),
    ],
)
def test_an_unusable_target_is_one_usage_error_at_session_start(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    monkeypatch.delenv("KVCANARY_TEST_UNSET_KEY", raising=False)
    url = closed_port_url()
    project(pytester, ini=f"kvcanary_target = {url}")  # the ini spelling of --kvcanary-target
    result = run(pytester, "--kvcanary-suite", "--kvcanary-cache-probe", "--kvcanary-out=o", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = "\n".join([*result.outlines, *result.errlines]).strip().splitlines()
    assert len(lines) <= 3, lines
    result.stderr.fnmatch_lines([message.format(url=url)])
    assert "Traceback" not in result.stderr.str()
    assert "During handling" not in result.stderr.str()
    assert not (pytester.path / "o").exists()  # before any test ran


class _NoModels(http.server.BaseHTTPRequestHandler):
    """A target that answers every request with 404: reachable, but it serves nothing."""

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def no_models_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoModels)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_config_file_supplies_settings_and_kvcanary_run_checks_its_overrides(
    pytester: pytest.Pytester, no_models_url: str
) -> None:
    pytester.makefile(".toml", kv=f'[run]\ntarget = "{no_models_url}"\nrequests = 5\n')
    project(
        pytester,
        test_user="""
            def test_bad_override(kvcanary_run):
                kvcanary_run(requestz=3)

            def test_no_model(kvcanary_run):
                kvcanary_run(requests=2)
        """,
    )
    result = run(pytester, "--kvcanary-config=kv.toml", "--kvcanary-out=o")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        ["*kvcanary: kvcanary_run() got unknown setting(s) requestz; known: *",
         "*kvcanary: could not read the target's KV pool size and context length from "
         f"{no_models_url} *"]
    )  # fmt: skip
    assert "During handling" not in result.stdout.str()  # one message, no chain before it


def test_a_bad_config_file_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makefile(".toml", kv="[run]\nbogus = 1\n")
    project(pytester, test_a="def test_a(): pass")
    result = run(pytester, "--kvcanary-config=kv.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "unknown key `bogus` in [run]" in result.stderr.str()


def test_loading_the_plugin_imports_nothing_heavy() -> None:
    # what `pytest` pays for the plugin when no kvcanary option is used
    heavy = ("torch", "pandas", "numpy", "httpx", "kvcanary.reference_engine",
             "kvcanary.harness.run.session", "kvcanary.harness.run.runner",
             "kvcanary.harness.plugin.target", "kvcanary.reports")  # fmt: skip
    code = (
        "import sys, kvcanary.harness.plugin.pytest_plugin\n"
        f"print(sorted(m for m in sys.modules\n"
        f"             if any(m == h or m.startswith(h + '.') for h in {heavy!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("family", ["xunit2", "xunit1"])
def test_a_checks_reason_goes_where_the_junit_family_allows_without_a_warning(
    pytester: pytest.Pytester, no_models_url: str, family: str
) -> None:
    # check 8 reads the target's pools: this one reports none, so the check skips, saying why
    project(pytester, ini=f"kvcanary_target = {no_models_url}\njunit_family = {family}")
    result = run(pytester, "--kvcanary-suite", "-k", "test_8", "--junitxml=junit.xml")
    result.assert_outcomes(skipped=1)
    assert "record_property is incompatible" not in result.stdout.str()
    assert "PytestWarning" not in result.stdout.str()
    root = ET.parse(pytester.path / "junit.xml").getroot()
    suite = root.find("testsuite")
    assert suite is not None
    case = suite.find("testcase")
    assert case is not None
    if family == "xunit2":  # its schema has no test case properties: the suite's carry it
        assert case.find("properties") is None
        name = "kvcanary_reason.test_8_kv_pool_holds_the_context"
        found = suite.findall(f"properties/property[@name='{name}']")
    else:
        found = case.findall("properties/property[@name='kvcanary_reason']")
    assert len(found) == 1
    assert found[0].get("value", "").startswith("the KV pool could not be read")

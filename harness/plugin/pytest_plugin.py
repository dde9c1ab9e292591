"""kvcanary's pytest plugin: options, fixtures, the `kvcanary` marker and the built-in suite.

Registered as the `kvcanary` entry point of `pytest11`, so installing kvcanary is enough and
`-p no:kvcanary` turns it off. What it adds:

    options    one group, `kvcanary`: `kvcanary run`'s options from `harness.run.options`,
               each spelled `--kvcanary-<name>`, plus `--kvcanary-suite` (and
               `--kvcanary-engine`, the alias of `--kvcanary-engine-preset`); each also
               readable from the ini file as `kvcanary_<name>`. Precedence, `harness.run.config`'s
               one merge: command line over ini file over `--kvcanary-config` TOML over
               defaults. Naming an engine preset anywhere starts the bundled engine.
    fixtures   `kvcanary_target` (session), `kvcanary_tenants`, `kvcanary_canaries`,
               `kvcanary_run` (a callable that runs a workload and returns a `WorkloadResult`)
    marker     `@pytest.mark.kvcanary`: the test drives the target; skipped without one
    suite      `--kvcanary-suite` adds `harness.plugin.suite` (nine checks) under node id
               `kvcanary`, as ordinary test items: -k, -x, --junitxml all apply
    summary    a `kvcanary` section at the end: every run's verdict, findings, report path
    preflight  at session start, a key variable that is not set or a target that does not
               answer is one usage error (exit 4) before any test (`harness.plugin.preflight`)

Start-up stays cheap on purpose: at import this module touches only `harness.run.options` and
`harness.run.option_flags` (data and argparse helpers). The target, the session runner, pandas
and the engine are imported by the fixture or hook that needs them, so the plugin costs
nothing in test runs that never use it. State lives in `config.stash`, never on module globals.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import pytest

from kvcanary.harness.run.option_flags import add_to_parser
from kvcanary.harness.run.options import PLUGIN_PREFIX, Option, options_for

if TYPE_CHECKING:
    from kvcanary.harness.plugin.target import RunWorkload, TargetUnderTest
    from kvcanary.harness.run.canary_factory import CanaryFactory
    from kvcanary.tenants.tenant import Tenant

GROUP = "kvcanary"
DEST_PREFIX = INI_PREFIX = "kvcanary_"
MARKER = "kvcanary"
SUITE_MODULE = "kvcanary.harness.plugin.suite"
SUITE_NODEID = "kvcanary"
NO_TARGET = (
    "kvcanary: no target configured; pass --kvcanary-target=URL or "
    "--kvcanary-engine=vulnerable|hardened (or set kvcanary_target in the ini file)"
)
PLUGIN_OPTIONS: tuple[Option, ...] = options_for("plugin")
"""`kvcanary run`'s options and the plugin's own (`suite`), as the plugin reads them."""

_TARGET_KEY = pytest.StashKey["TargetUnderTest"]()
_GIVEN_KEY = pytest.StashKey[dict[str, Any]]()


class _OptionGroup:
    """`add_to_parser` speaks argparse; pytest's group takes the same arguments as `addoption`.

    Destinations get the `kvcanary_` prefix so that `timeout` or `target` never collide with
    another plugin's options (pytest-timeout has a `timeout`).
    """

    def __init__(self, group: pytest.OptionGroup) -> None:
        self._group = group

    def add_argument(self, *flags: str, dest: str, **kwargs: Any) -> None:
        self._group.addoption(*flags, dest=DEST_PREFIX + dest, **kwargs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(GROUP, "kvcanary: cross-tenant KV-cache leak checks")
    add_to_parser(
        cast(argparse._ArgumentGroup, _OptionGroup(group)), PLUGIN_OPTIONS, prefix=PLUGIN_PREFIX
    )
    for option in PLUGIN_OPTIONS:
        kind = {"flag": "bool", "append": "args"}.get(option.action, "string")
        for key, about in _ini_keys(option):
            parser.addini(INI_PREFIX + key, about, type=kind, default=None)  # type: ignore[arg-type]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: the test drives the kvcanary target; skipped when no --kvcanary-target or "
        "--kvcanary-engine is configured",
    )
    given = _given(config)
    config.stash[_GIVEN_KEY] = given
    if given:  # settle every setting now, so a bad one is a usage error before any test
        _target(config)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """A target that cannot be used (a key variable unset, no answer) is one usage error now,
    before the session's header, not the same failure in every kvcanary test."""
    config = session.config
    if not _given_settings(config) or hasattr(config, "workerinput") or config.option.collectonly:
        return  # nothing configured; an xdist worker (its controller checked); nothing runs
    target = _target(config)
    if not target.configured:
        return
    from kvcanary.canaries.errors import KvcanaryError
    from kvcanary.harness.plugin.preflight import preflight

    try:
        preflight(target.config)
    except KvcanaryError as exc:
        raise pytest.UsageError(f"kvcanary: {exc}") from None


def pytest_unconfigure(config: pytest.Config) -> None:
    target = config.stash.get(_TARGET_KEY, None)
    if target is not None:
        target.close()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """With --kvcanary-suite, add the check suite's items (before -k / -m deselect any)."""
    if not _given_settings(config).get("suite"):
        return
    spec = find_spec(SUITE_MODULE)
    assert spec is not None, SUITE_MODULE
    assert spec.origin is not None, SUITE_MODULE
    path = Path(spec.origin)
    if any(item.path == path for item in items):  # collected explicitly as well
        return
    module = pytest.Module.from_parent(session, path=path, nodeid=SUITE_NODEID)
    items.extend(session.genitems(module))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker(MARKER) is not None and not _target(item.config).configured:
        pytest.skip(NO_TARGET)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    target = config.stash.get(_TARGET_KEY, None)
    if target is None or not (target.runs or target.audits or target.checks):
        return
    from kvcanary.harness.plugin.target import session_summary

    terminalreporter.section("kvcanary")
    for line in session_summary(target):
        terminalreporter.write_line(line)


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kvcanary_target(pytestconfig: pytest.Config) -> Iterator[TargetUnderTest]:
    """The target under test: the remote URL, or the bundled engine, started for the session.

    Skips the test (with the reason) when neither --kvcanary-target nor --kvcanary-engine is
    given; fails it with one line when the engine cannot start.
    """
    from kvcanary.canaries.errors import KvcanaryError

    target = _target(pytestconfig)
    if not target.configured:
        pytest.skip(NO_TARGET)
    try:
        target.start()
    except KvcanaryError as exc:
        fail_plainly(f"kvcanary: {exc}")
    yield target
    target.close()


@pytest.fixture(scope="session")
def kvcanary_tenants(pytestconfig: pytest.Config) -> list[Tenant]:
    """The simulated tenants (`tenant-0` ...), --kvcanary-tenants of them, sharing one key."""
    from kvcanary.tenants.tenant import default_tenants

    config = _target(pytestconfig).config
    return default_tenants(config.tenants, config.api_key_env)


@pytest.fixture(scope="session")
def kvcanary_canaries(pytestconfig: pytest.Config, kvcanary_tenants: list[Tenant]) -> CanaryFactory:
    """Builds canary-laced prompts of exact token counts and finds their canaries again."""
    from kvcanary.canaries.errors import ConfigError
    from kvcanary.harness.run.canary_factory import CanaryFactory

    config = _target(pytestconfig).config
    try:
        return CanaryFactory.create(
            kvcanary_tenants,
            tokenizer=config.tokenizer,
            seed=config.seed,
            page_size=config.page_size,
            strict_page_size=config.strict_page_size,
        )
    except ConfigError as exc:
        fail_plainly(f"kvcanary: {exc}")


@pytest.fixture
def kvcanary_run(kvcanary_target: TargetUnderTest, request: pytest.FixtureRequest) -> RunWorkload:
    """`kvcanary_run(requests=40, profile="below", ...)` runs a workload against the target
    and returns its `WorkloadResult` (`.findings`, `.observations`, `.summary`, `.verdict`,
    `.out_dir`). Each call writes its own directory under --kvcanary-out."""
    from kvcanary.canaries.errors import KvcanaryError
    from kvcanary.harness.plugin.target import WorkloadResult

    def run(**overrides: Any) -> WorkloadResult:
        try:
            return kvcanary_target.run(request.node.name, **overrides)
        except KvcanaryError as exc:
            fail_plainly(f"kvcanary: {exc}")

    return run


def fail_plainly(message: str) -> NoReturn:
    """Fail the current test with `message` alone: no traceback, and none of the exceptions
    being handled chained before it (pytest would print each one's message first)."""
    raise pytest.fail.Exception(message, pytrace=False) from None


# -- settings ----------------------------------------------------------------------------------


def _ini_keys(option: Option) -> list[tuple[str, str]]:
    """The ini keys that spell `option` (its name, then its aliases) and their help lines."""
    main = (option.name, f"{option.help} (as {option.plugin_flag})")
    return [main, *((alias, f"Alias of {INI_PREFIX}{option.name}.") for alias in option.aliases)]


def _given(config: pytest.Config) -> dict[str, Any]:
    """The plugin settings given on the command line, over those in the ini file."""
    from kvcanary.canaries.errors import ConfigError
    from kvcanary.harness.run.config import Layer, coerce_values, merge

    ini: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for option in PLUGIN_OPTIONS:
        for key, _ in reversed(_ini_keys(option)):  # the option's own name over an alias
            raw = config.getini(INI_PREFIX + key)
            if raw is not None and raw != [] and raw != "":
                ini[option.name], spelled[option.name] = raw, INI_PREFIX + key
    flags: dict[str, Any] = {}
    for option in PLUGIN_OPTIONS:
        value = config.getoption(DEST_PREFIX + option.name)
        if value is not None:
            flags[option.name] = tuple(value) if option.action == "append" else value
    try:
        ini = coerce_values(ini, lambda option, _: f"ini {spelled[option.name]}")
        return merge(Layer("the ini file", ini), Layer("the command line", flags))
    except ConfigError as exc:
        raise pytest.UsageError(f"kvcanary: {exc}") from None


def _given_settings(config: pytest.Config) -> dict[str, Any]:
    """A copy of the settings `pytest_configure` read (none before it ran)."""
    if _GIVEN_KEY not in config.stash:
        return {}
    given: dict[str, Any] = config.stash[_GIVEN_KEY]
    return dict(given)


def _target(config: pytest.Config) -> TargetUnderTest:
    """The session's target, made from the settings on first need (kept in `config.stash`)."""
    target = config.stash.get(_TARGET_KEY, None)
    if target is not None:
        return target
    from kvcanary.canaries.errors import ConfigError
    from kvcanary.harness.plugin.target import TargetUnderTest
    from kvcanary.harness.run.config import Layer, RunConfig, layered

    given = _given_settings(config)
    try:
        values = layered("run", Layer("the pytest flags", given), config_path=given.get("config"))
        # the engine is the session's, not each run's: named anywhere, it is started
        engine, fixes = values.pop("engine_preset", None), values.pop("engine_fix", ())
        out = values.get("out")
        target = TargetUnderTest(
            RunConfig.from_values("run", values),
            engine=engine,
            engine_fixes=fixes,
            out_root=Path(out) if out is not None else None,
        )
    except ConfigError as exc:
        raise pytest.UsageError(f"kvcanary: {exc}") from None
    config.stash[_TARGET_KEY] = target
    return target

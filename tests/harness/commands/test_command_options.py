"""`kvcanary audit` and `kvcanary repro` as the registry defines them: their shared options
parse, default and merge as `kvcanary run`'s do (one URL check, scenario below the flags)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvcanary.harness.cli import main
from kvcanary.harness.scenarios import shipped_file


def closed_port_url() -> str:
    """A loopback URL nothing listens on: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "p0:30000"], "--prefill: not an http(s) URL: 'p0:30000'"),
        (["--target", "http://127.0.0.1:1", "--timeout", "soon"], "--timeout: not a duration"),
        (["--target", "http://127.0.0.1:1", "--api-key-env", "sk-123"], "--api-key-env"),
    ],
)
def test_audit_values_are_checked_by_the_registry_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["audit", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "sk-123" not in err  # a pasted key is never echoed
    assert err.count("\n") == 1


def test_audit_timeout_reads_durations_and_defaults_to_30s(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["audit", "--target", closed_port_url(), "--timeout", "2s", "--json"]) == 3
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    assert "Per-request timeout, the probe included. Default: 30s." in capsys.readouterr().out


def test_repro_target_is_the_registrys_url_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["repro", "glm53-incident", "--target", "localhost:8000"])
    assert exit_info.value.code == 2
    assert "argument --target: not an http(s) URL: 'localhost:8000'" in capsys.readouterr().err


def test_repro_flags_override_the_scenarios_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario_url, flag_url = closed_port_url(), closed_port_url()
    shipped = shipped_file("glm53-incident-target")
    assert shipped is not None
    text = shipped.read_text(encoding="utf-8")
    path = tmp_path / "own-target.toml"
    path.write_text(f'target = "{scenario_url}"\n{text}', encoding="utf-8")
    for argv, url in (([], scenario_url), (["--target", flag_url], flag_url)):
        assert main(["repro", str(path), *argv, "--out", str(tmp_path / "out")]) == 3
        verdict = capsys.readouterr().out.splitlines()[2]
        assert verdict.startswith(f"verdict: INCONCLUSIVE - cannot reach the target at {url}")

"""A credential is never printed or written by any command (issue 16).

Two ways a key escapes: pasted where a variable NAME belongs (refused before anything starts,
showing at most its first 3 characters and its length), and echoed back by a hostile target
(quoted in error bodies, answers and server info). Every output stream (at the fd level, so
child processes and the progress display count too), the journal, every report, evidence
file and re-rendered report of `run`, `soak`, `repro`, `audit` and `report` is grepped for
any 4 consecutive characters of the planted key.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from misbehaving_server import serve
from recorded_targets import RecordedTarget, Seen, fixture_json, serving
from test_cli_run import LIMIT_FLAGS, fake_target

from kvcanary.harness.cli import main

KEY = "sk-Zq8xW3vKp0LmNb7TrQe5Yc"
"""Every 4-character window is mixed case and digits: no legitimate output contains one."""
KEY_ENV = "KVCANARY_PLANTED_KEY"
WINDOWS = [KEY[i : i + 4] for i in range(len(KEY) - 3)]


def leaked(text: str) -> list[str]:
    """The windows of the key longer than its first 3 characters that `text` contains."""
    return [w for w in WINDOWS if w in text]


DATA_URI = re.compile(r"data:[\w/+.-]+;base64,[A-Za-z0-9+/=]+")
"""The report's embedded plots: 120 kB of base64 PNG holds one of the key's 21 windows
by chance in about one run in seven (21 x 120k / 64^4), and pixels cannot carry its text."""


def leaked_in_files(root: Path) -> dict[str, list[str]]:
    found = {}
    for path in root.rglob("*"):
        if path.is_file():
            text = path.read_bytes().decode("utf-8", "replace")
            hits = leaked(DATA_URI.sub("data:", text))
            if hits:
                found[path.relative_to(root).as_posix()] = hits
    return found


SCENARIO_WITH_KEY = """
name = "pasted-key"
description = "a key pasted where a variable name belongs"
[target]
url = "{url}"
[expect]
outcome = "clean"
[tenants]
count = 2
api_key_env = {{ tenant-0 = "{key}" }}
[[steps]]
kind = "victims"
sizes = [100]
count = 1
"""


@pytest.mark.parametrize(
    "surface",
    ["run", "soak", "audit", "repro", "run-config", "repro-scenario", "plugin", "plugin-ini"],
)
def test_a_key_pasted_for_a_variable_name_is_refused_without_echo(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], surface: str
) -> None:
    target = RecordedTarget({})
    out = tmp_path / "out"
    with serving(target) as url:
        common = ["--target", url, "--out", str(out)]
        if surface in ("run", "soak"):
            argv = [surface, *common, "--duration", "5s", "--api-key-env", KEY]
        elif surface == "audit":
            argv = ["audit", "--target", url, "--api-key-env", KEY]
        elif surface == "repro":
            argv = ["repro", "hardened-control", *common, "--api-key-env", KEY]
        elif surface == "run-config":
            config = tmp_path / "kvcanary.toml"
            config.write_text(f'[run]\napi-key-env = "{KEY}"\n')
            argv = ["run", *common, "--config", str(config)]
        elif surface == "repro-scenario":
            scenario = tmp_path / "pasted.toml"
            scenario.write_text(SCENARIO_WITH_KEY.format(url=url, key=KEY))
            argv = ["repro", str(scenario), "--out", str(out)]
        else:
            argv = []
        if surface.startswith("plugin"):
            (tmp_path / "test_x.py").write_text("def test_x(): pass\n")
            flags = ["--kvcanary-target", url, f"--kvcanary-api-key-env={KEY}"]
            if surface == "plugin-ini":
                (tmp_path / "pytest.ini").write_text(f"[pytest]\nkvcanary_api_key_env = {KEY}\n")
                flags = ["--kvcanary-target", url]
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *flags],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=120,
            )
            status, printed = proc.returncode, proc.stdout + proc.stderr
            assert status in (2, 4), printed  # pytest's usage error
        else:
            try:
                status = main(argv)
            except SystemExit as exc:  # argparse's usage error
                status = int(exc.code or 0)
            captured = capfd.readouterr()
            printed = captured.out + captured.err
            assert status == 2, printed
    assert leaked(printed) == [], printed
    assert f"{len(KEY)} characters" in printed, printed
    assert "Traceback" not in printed
    assert target.seen == []  # refused before anything was sent
    assert not out.exists()  # and before a run directory was made


def echoing_audit_target() -> RecordedTarget:
    """SGLang server info that quotes the caller's Authorization header back in its args,
    its model path and its error bodies (as some gateways and debug servers do)."""

    def server_info(seen: Seen) -> tuple[int, str, bytes]:
        info = fixture_json("sglang_server_info.json")
        auth = seen.headers.get("authorization", "")
        info["api_key"] = auth
        info["served_model_name"] = f"model {auth}"
        return 200, "application/json", json.dumps(info).encode()

    def echo_404(seen: Seen) -> tuple[int, str, bytes]:
        auth = seen.headers.get("authorization", "")
        return 404, "application/json", json.dumps({"error": f"no route for {auth}"}).encode()

    routes: dict[str, Any] = {"GET /get_server_info": server_info}
    for route in ("GET /v1/models", "GET /metrics", "POST /v1/completions"):
        routes[route] = echo_404
    return RecordedTarget(routes)


@pytest.mark.parametrize("command", ["run", "run-raw", "soak", "repro", "audit"])
def test_a_planted_key_is_never_printed_or_written_by_any_command(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    out = tmp_path / "run"
    key_flags = ["--api-key-env", KEY_ENV]
    printed: list[str] = []
    if command == "audit":
        target = echoing_audit_target()
        with serving(target) as url:
            for extra in ([], ["--json"], ["--probe"]):
                main(["audit", "--target", url, *key_flags, *extra])
                captured = capfd.readouterr()
                printed.append(captured.out + captured.err)
        assert all(s.headers.get("authorization") == f"Bearer {KEY}" for s in target.seen)
    else:
        with serve(fake_target(echo_auth=True)) as url:
            if command == "repro":
                params = ["pool_tokens=384", "context_tokens=768", "page_size=16", "model=fake"]
                params += ["num_victims=4", "num_probes=2"]
                argv = ["repro", "glm53-incident-target", "--target", url, "--out", str(out)]
                argv += [arg for p in params for arg in ("--param", p)]
            else:
                argv = [command.removesuffix("-raw"), "--target", url, *LIMIT_FLAGS]
                argv += ["--out", str(out)]
                argv += ["--duration", "3s"] if command == "soak" else ["--requests", "30"]
                argv += ["--keep-raw-evidence"] if command == "run-raw" else []
            main([*argv, *key_flags])
            captured = capfd.readouterr()
            printed.append(captured.out + captured.err)
        assert (out / "journal.jsonl").exists()
        # the reports rebuilt from the journal, in place and elsewhere, leak nothing either
        rendered = tmp_path / "rendered"
        main(["report", str(out)])
        main(["report", str(out), "--out", str(rendered)])
        captured = capfd.readouterr()
        printed.append(captured.out + captured.err)
        assert {"report.html", "report.md", "summary.json", "junit.xml"} <= {
            p.name for p in rendered.iterdir()
        }
        assert leaked_in_files(rendered) == {}
        assert leaked_in_files(out) == {}
        journal = (out / "journal.jsonl").read_text()
        assert "[credential redacted]" in journal or " chars redacted, sha256:" in journal
    for text in printed:
        assert leaked(text) == [], text
        assert "Traceback" not in text

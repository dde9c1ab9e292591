"""Cross-run attribution: `--keyring` keeps each run's key, so a later run that meets an
earlier run's canary names that run, its tenant, the request and its age."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from fake_openai import (
    LIMIT_FLAGS,
    POOL,
    Receive,
    Scope,
    Send,
    json_response,
    num_prompt_tokens,
    read_body,
    sse_event,
    sse_finish,
    sse_start,
)
from misbehaving_server import serve
from test_cli_run import fake_target, of_type, records

from kvcanary.canaries import CanaryMinter
from kvcanary.canaries.errors import ConfigError
from kvcanary.canaries.packing import unpack_spans
from kvcanary.harness.cli import main
from kvcanary.harness.run.keyring import EarlierRuns, KeyEntry, Keyring

KEY = bytes(range(32))


def entry(run_id: str = "20261202T030000Z", age_s: float = 0.0) -> KeyEntry:
    made = KeyEntry.of(KEY, CanaryMinter(KEY), run_id, ["tenant-0", "tenant-1", "tenant-2"])
    return dataclasses.replace(made, t_wall=made.t_wall - age_s)


def test_a_keyring_is_created_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    keyring = Keyring.open(path)
    assert keyring.entries == {}
    assert not path.exists()  # opening writes nothing
    keyring.remember("abcd0123", entry())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Keyring.open(path).entries == keyring.entries
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_keyring_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "keys.json"
    Keyring.open(path).remember("abcd0123", entry())
    os.chmod(path, mode)
    with pytest.raises(ConfigError, match=f"readable by group or others.*chmod 600 {path}"):
        Keyring.open(path)


def test_a_file_that_is_no_keyring_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text('{"schema": 1, "keys": {"x": {"key": "zz"}}}')
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="not a kvcanary keyring"):
        Keyring.open(path)


def test_an_earlier_runs_canary_is_named_with_its_run_tenant_request_and_age() -> None:
    canary = CanaryMinter(KEY).mint(tenant=2, request=14, index=3)
    earlier = EarlierRuns([entry(age_s=14 * 3600 + 60)])
    found = earlier.attribute(canary)
    assert found is not None
    assert found.describe() == (
        "tenant-2's canary from run 20261202T030000Z (request t2-r000014), 14 h old"
    )
    assert earlier.attribute(CanaryMinter.random().mint(2, 14, 3)) is None


def replaying_target(canary: str) -> Any:
    """A safe target that quotes `canary` (an earlier run's) in every streamed answer."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = json.loads(await read_body(receive) or b"{}")
        if scope["method"] == "GET":
            await json_response(send, 200, {"data": [{"id": "fake"}]})
            return
        num_tokens = num_prompt_tokens(request)
        if num_tokens >= POOL:
            await json_response(send, 400, {"error": {"message": "too long"}})
            return
        usage = {"prompt_tokens": num_tokens, "completion_tokens": 4}
        if not request.get("stream", True):
            answer = {"choices": [{"index": 0, "text": " w"}], "usage": usage}
            await json_response(send, 200, answer)
            return
        await sse_start(send)
        await sse_event(send, {"choices": [{"index": 0, "text": f" {canary} and more"}]})
        await sse_finish(send, usage)

    return app


def test_run_b_names_run_a_and_its_tenant_for_a_canary_a_minted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keyring = tmp_path / "keyring.json"
    common = [*LIMIT_FLAGS, "--requests", "12", "--tenants", "2", "--keyring", str(keyring)]
    with serve(fake_target()) as url:
        assert main(["run", "--target", url, *common, "--out", str(tmp_path / "a")]) == 0
    assert stat.S_IMODE(keyring.stat().st_mode) == 0o600
    run_a = records(tmp_path / "a")
    plan = of_type(run_a, "plan")[3]
    canary = unpack_spans(plan["canary_spans"])[0].text  # journaled packed
    with serve(replaying_target(canary)) as url:
        assert main(["run", "--target", url, *common, "--out", str(tmp_path / "b")]) == 1
    capsys.readouterr()
    findings = of_type(records(tmp_path / "b"), "finding")
    earlier = [f for f in findings if f["details"].get("earlier_run")]
    assert earlier, findings
    run_id = run_a[0]["run_id"]
    assert earlier[0]["kind"] == "unknown_canary"
    assert earlier[0]["details"]["earlier_run"] == {
        **earlier[0]["details"]["earlier_run"],
        "run_id": run_id,
        "tenant": plan["tenant"],
        "request_id": plan["request_id"],
    }
    assert f"{plan['tenant']}'s canary from run {run_id}" in earlier[0]["summary"]
    assert len(json.loads(keyring.read_text())["keys"]) == 2


def test_without_the_flag_no_key_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with serve(fake_target()) as url:
        argv = ["run", "--target", url, *LIMIT_FLAGS, "--requests", "12", "--out", "out"]
        assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not list((tmp_path / "out").glob("*keyring*"))


def test_a_readable_keyring_stops_the_run_before_anything_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    Keyring.open(path).remember("abcd0123", entry())
    os.chmod(path, 0o644)
    argv = ["run", "--target", "http://127.0.0.1:9", *LIMIT_FLAGS, "--keyring", str(path)]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"kvcanary: error: --keyring {path}: readable by group or others (mode 644); "
        f"it holds canary keys: chmod 600 {path}"
    ]
    assert not (tmp_path / "out").exists()

"""`--ray` hands no credential and no canary key to Ray to keep: not in its logs, not
anywhere under its temp dir.

A local Ray (bound to 127.0.0.1, 2 CPUs, a small object store, its own temp dir) runs a
small `--ray` run whose tenants send a 64-character key, with a keyring (outside both
directories) to learn the run's canary key from, which every actor is handed too. Every
file Ray wrote, every file of the run directory and everything the process printed is then
searched for the credential and each of its 8-character windows, and for the canary key's
hex and raw bytes, each of their 64-bit windows: none may appear. Credentials that travel
in a `runtime_env` are written in clear into Ray's `runtime_env_agent.log`.
"""

from __future__ import annotations

import json
import shutil
import string
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from misbehaving_server import serve
from test_cli_run import LIMIT_FLAGS, fake_target

from kvcanary.harness.cli import main

ray = pytest.importorskip("ray", reason="--ray needs Ray (the dev extra installs it)")
pytestmark = pytest.mark.slow

KEY = "sk-live-" + (string.ascii_letters + string.digits)[3:59]
"""64 characters, none of its 8-character windows a word Ray would write on its own."""
KEY_VAR = "KVC_RAY_SECRET"


@pytest.fixture
def ray_temp_dir() -> Iterator[Path]:
    """Ray's own temp dir: short, since Ray's socket paths under it must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def windows(secret: bytes, width: int = 8) -> list[bytes]:
    return [secret[i : i + width] for i in range(len(secret) - width + 1)]


def hits(data: bytes, run_key: bytes = b"") -> list[bytes]:
    """The windows of the credential (8 characters) and of the canary key (16 hex digits,
    8 raw bytes: 64 bits, which Ray's own hex ids never match by chance) in `data`."""
    found = windows(KEY.encode()) + windows(run_key.hex().encode(), 16) + windows(run_key)
    return [window for window in found if window and window in data]


def test_a_ray_run_leaves_its_key_nowhere(
    tmp_path: Path,
    ray_temp_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert len(KEY) == 64
    monkeypatch.setenv(KEY_VAR, KEY)
    out, keyring = tmp_path / "run", tmp_path / "keys.json"
    ray.init(
        num_cpus=2,
        object_store_memory=80 * 1024 * 1024,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=str(ray_temp_dir),
    )
    try:
        argv = ["run", *LIMIT_FLAGS, "--requests", "12", "--concurrency", "2", "--ray"]
        argv += ["--api-key-env", KEY_VAR, "--out", str(out), "--keyring", str(keyring)]
        with serve(fake_target(echo_auth=True)) as url:  # it quotes the key back, too
            status = main([*argv, "--target", url])
    finally:
        ray.shutdown()
    printed = capfd.readouterr()
    assert status == 0, printed.err
    (entry,) = json.loads(keyring.read_text())["keys"].values()
    run_key = bytes.fromhex(entry["key"])
    assert len(run_key) == 32

    files = [p for root in (ray_temp_dir, out) for p in root.rglob("*") if p.is_file()]
    assert any(p.name == "runtime_env_agent.log" for p in files), "Ray wrote no logs here"
    assert out / "journal.jsonl" in files
    found = {str(p): hits(p.read_bytes(), run_key) for p in files}
    assert {path: found for path, found in found.items() if found} == {}
    assert hits((printed.out + printed.err).encode(), run_key) == []

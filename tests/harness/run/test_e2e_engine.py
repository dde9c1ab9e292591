"""`kvcanary run` against the bundled reference engine over HTTP: the product's main job.

The vulnerable preset must be found leaking (the README's command, all defaults); the
hardened preset must come out clean over hundreds of requests; each fix switch that closes
the over-pool leak class must remove every cross-tenant canary, while `deferred_release`
(a page-lifetime fix for aborts, not this class) must not, which also shows that the same
small workload does reach the leak.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcanary.harness.cli import main

pytestmark = pytest.mark.slow

SMALL_CONTEXT = 1024
"""Fix and hardened runs use a smaller engine: the same mechanics, prompts 4x shorter."""


def journal(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


def summary(out: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return loaded


@pytest.mark.timing
def test_the_readme_command_finds_the_leak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["run", "--out", str(out)]) == 1
    printed = capsys.readouterr()
    assert printed.out.startswith("verdict: LEAK")
    assert str(out / "report.html") in printed.out
    assert "starting the bundled reference engine (vulnerable)" in printed.err
    assert "phase probe" in printed.err
    found = summary(out)["counts"]["findings"]
    for kind in ("cross_tenant_canary", "unsafe_accept", "fast_prefill"):
        assert found[kind] > 0, (kind, found)
    assert not found.get("prompt_tokens_mismatch"), found  # the client sees decode's usage
    rows = journal(out)
    probes = [r["request_id"] for r in rows if r["type"] == "plan" and r["intent"] == "probe"]
    leaked = [
        probes.index(r["request_id"])
        for r in rows
        if r["type"] == "finding"
        and r["kind"] == "cross_tenant_canary"
        and r["request_id"] in probes
    ]
    assert leaked, "no probe was answered with another tenant's canary"
    assert leaked[0] <= 2, f"the first leaking probe was probe #{leaked[0]}"


def _run_against(engine_url: str, out: Path, *args: str) -> int:
    return main(["run", "--target", engine_url, "--out", str(out), "--seed", "11", *args])


def test_the_hardened_engine_is_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvcanary.reference_engine.server.launch import running_engine

    with running_engine("hardened", context_length=SMALL_CONTEXT) as engine:
        status = _run_against(engine.base_url, tmp_path, "--requests", "120", "--concurrency", "2")
    printed = capsys.readouterr()
    assert status == 0, printed.out
    result = summary(tmp_path)
    assert result["verdict"] == "clean"
    assert result["counts"]["findings_total"] == 0
    assert result["counts"]["requests"]["total"] == 120
    assert result["evidence"]["num_above_limit_answered"] > 0
    assert printed.out.startswith("verdict: CLEAN")


@pytest.mark.parametrize(
    ("fix", "leaks"),
    [
        ("admission_retire", False),
        ("coverage_check", False),
        ("kv_checksum", False),
        ("page_tags", False),
        ("zero_on_free", False),
        ("deferred_release", True),  # a fix for aborted transfers; over-pool still leaks
    ],
)
def test_each_fix_switch_alone(tmp_path: Path, fix: str, leaks: bool) -> None:
    from kvcanary.reference_engine.server.launch import running_engine

    with running_engine("vulnerable", fixes=(fix,), context_length=SMALL_CONTEXT) as engine:
        status = _run_against(engine.base_url, tmp_path, "--requests", "30")
    result = summary(tmp_path)
    found = result["counts"]["findings"]
    assert result["evidence"]["num_above_limit_answered"] > 0
    assert (found["cross_tenant_canary"] > 0) == leaks, found
    assert status == (1 if result["counts"]["findings_total"] else 0)


def test_chat_prompts_are_counted_with_the_template(tmp_path: Path) -> None:
    """The chat template's size is measured first, so usage matches the plans exactly."""
    from kvcanary.reference_engine.server.launch import running_engine

    with running_engine("hardened", context_length=SMALL_CONTEXT) as engine:
        status = _run_against(engine.base_url, tmp_path, "--api", "chat", "--requests", "24")
    result = summary(tmp_path)
    assert status == 0, result["verdict_reasons"]
    assert result["api"] == "chat"
    accepted = [r for r in journal(tmp_path) if r["type"] == "observation" and not r["error_kind"]]
    assert accepted
    assert all(r["usage"]["prompt_tokens"] is not None for r in accepted)

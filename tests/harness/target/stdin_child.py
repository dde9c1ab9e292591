"""Stopping a helper subprocess that serves until its stdin closes (the llama.cpp server
script, the vLLM tests' PD proxy)."""

from __future__ import annotations

import subprocess

STOP_TIMEOUT_S = 30


def stop_stdin_child(process: subprocess.Popen[str]) -> None:
    """Close `process`'s stdin and wait for it to exit; kill it if it has not within
    `STOP_TIMEOUT_S`. Its stdout pipe is closed too."""
    assert process.stdin is not None
    process.stdin.close()
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()

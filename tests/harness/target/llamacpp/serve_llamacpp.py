"""Serve a GGUF model with llama.cpp's own HTTP server (xllamacpp) until stdin closes.

    python serve_llamacpp.py MODEL.gguf N_CTX N_PARALLEL

Prints `listening <url>` once the server listens on a free 127.0.0.1 port. A subprocess, so
the test that started it can always stop it (the binding has no stop call), and the
server's log stays out of the test's output.
"""

from __future__ import annotations

import sys

import xllamacpp as xlc


def main() -> None:
    model, n_ctx, n_parallel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    params = xlc.CommonParams()
    params.model.path = model
    params.n_ctx = n_ctx
    params.n_parallel = n_parallel
    params.hostnames = ["127.0.0.1"]
    params.port = 0  # a free port, which the server reports
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.warmup = False
    params.endpoint_props = True
    params.endpoint_slots = True
    server = xlc.Server(params)
    print(f"listening {server.listening_address}", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    del server


if __name__ == "__main__":
    main()

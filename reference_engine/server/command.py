"""`kvcanary serve`: run the bundled reference engine until interrupted.

The help text is generated from `reference_engine.config.PRESETS` and `FIXES`, so every
preset and fix switch is explained with the upstream SGLang change it models. Only
`reference_engine.config` (no torch) is imported at registration; fastapi, uvicorn and the
engine load inside the handler. The engine listens on loopback unless `--allow-remote` is
given: it is a deliberately vulnerable server that returns other requests' data.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import math
import textwrap
import time
from collections.abc import Callable
from typing import Any

from kvcanary.canaries.errors import ConfigError, RunIncomplete

_DEFAULT_PORT = 30000  # SGLang's default


_ENDPOINTS = (
    "endpoints: /v1/completions, /v1/chat/completions, /generate, /v1/models, /v1/tokenize, "
    "/v1/detokenize, /get_model_info, /model_info, /get_server_info, /server_info, /metrics, "
    "/health, and the debug endpoint /kvcanary/state (allocated pages per side); with "
    "--processes the prefill and decode servers can be fronted by SGLang's own router "
    "(sglang-router --pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL)"
)
_DESCRIPTION = (
    "Run the bundled miniature SGLang-style prefill/decode engine behind an OpenAI-compatible "
    "API: a mini_lb router, a prefill server and a decode server, each with its own KV pool. "
    "The vulnerable preset answers prompts longer than the prefill pool with HTTP 200 and "
    "text read from other requests' stale KV pages; each fix switch models the upstream "
    "change that closes one path. Ctrl-C stops it."
)


def _help_epilog() -> str:
    from kvcanary.reference_engine.config import FIXES, PRESETS

    def block(title: str, entries: dict[str, str]) -> str:
        lines = [title]
        for name, text in entries.items():
            lines.append(
                textwrap.fill(text, 88, initial_indent=f"  {name:<20}", subsequent_indent=" " * 22)
            )
        return "\n".join(lines)

    return "\n\n".join(
        [
            block("presets:", PRESETS),
            block("fix switches (--fix NAME, repeatable; added to the preset's):", FIXES),
            textwrap.fill(_ENDPOINTS, 88),
        ]
    )


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the bundled reference engine (vulnerable, patched, hardened or race)",
        description=textwrap.fill(_DESCRIPTION, 88),
        epilog=_help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_shape_options(parser.add_argument)
    _add_model_options(parser.add_argument)
    _add_server_options(parser.add_argument)
    parser.set_defaults(handler=_serve)


def _add_shape_options(add: Callable[..., Any]) -> None:
    """The preset, its fixes and the pools: what the engine models."""
    from kvcanary.reference_engine.config import PRESETS

    add(
        "--preset",
        default="vulnerable",
        metavar="{" + ",".join(PRESETS) + "}",
        help="engine preset (default vulnerable; see below)",
    )
    add(
        "--fix",
        action="append",
        default=[],
        metavar="NAME",
        help="turn on a fix switch (see below); repeatable",
    )
    for side in ("prefill", "decode"):
        add(
            f"--{side}-pool-tokens",
            type=int,
            metavar="N",
            help=f"{side} KV pool size in tokens (default: from the preset)",
        )
    add(
        "--context-length",
        type=int,
        metavar="N",
        help="advertised context length, /v1/models max_model_len (default 4096; the "
        "preset's pools scale with it)",
    )
    add("--page-size", type=int, metavar="N", help="tokens per KV page (default 16)")
    add(
        "--prefix-cache",
        action="store_true",
        help="turn on the prefill side's radix prefix cache (off by default, as with SGLang's "
        "--disable-radix-cache); it is shared by every tenant unless the cache_salt or "
        "derive_cache_salt fix is on",
    )
    add(
        "--transfer-bandwidth",
        type=float,
        metavar="BYTES_PER_S",
        help="bandwidth of the prefill-to-decode KV link: each KV write is in flight for its "
        "size / bandwidth, writes of different requests concurrently, so a large write posted "
        "before an abort can land after a later request's writes (default: writes land at once)",
    )
    add(
        "--merge-prefill-usage",
        action="store_true",
        help="model a gateway that copies prefill's usage.prompt_tokens into decode's answer "
        "(the vulnerable prefill's placeholder says 1); SGLang's routers do not, and it is "
        "off in every preset",
    )


def _add_model_options(add: Callable[..., Any]) -> None:
    """How the model computes: copying noise, KV element type, attention path, device."""
    from kvcanary.reference_engine.config import ATTENTION_PATHS, KV_DTYPES

    add(
        "--copy-noise",
        metavar="X",
        help="how noisily the recall model copies what it reads, 0 (exact page-aligned quotes) "
        "to 1 (runs of stale text with dropped and substituted tokens and drift); default 0.3",
    )
    add(
        "--dtype",
        metavar="{" + ",".join(KV_DTYPES) + "}",
        help="the KV pools' element type, and so the pages' on the wire (default float32)",
    )
    add(
        "--attention",
        metavar="{" + ",".join(ATTENTION_PATHS) + "}",
        help="which paged attention the sides run: "
        + "; ".join(f"{name}: {text}" for name, text in ATTENTION_PATHS.items())
        + ". Default auto; the line after the listening line says which one runs",
    )
    add("--device", help="cpu (default) or cuda[:N]")


def _add_server_options(add: Callable[..., Any]) -> None:
    """Where it listens and in how many processes."""
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    add(
        "--port",
        type=int,
        default=_DEFAULT_PORT,
        help=f"router port (default {_DEFAULT_PORT}; 0 picks a free one)",
    )
    add(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host (the engine leaks data by design)",
    )
    add(
        "--processes",
        action="store_true",
        help="run prefill, decode and router as separate processes; KV pages cross a TCP socket",
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    names = ("prefill_pool_tokens", "decode_pool_tokens", "context_length", "page_size", "device")
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    for name in names[:-1]:  # sizes: a zero or negative one is a usage error, not a crash
        if name in overrides and overrides[name] < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be a positive number of tokens, got {overrides[name]}")
    if args.prefix_cache:
        overrides["prefix_cache"] = True
    if args.transfer_bandwidth is not None:
        overrides["transfer_bandwidth_bytes_per_s"] = args.transfer_bandwidth
    if args.merge_prefill_usage:
        overrides["merge_prefill_usage"] = True
    if args.copy_noise is not None:
        overrides["copy_noise"] = _copy_noise(args.copy_noise)
    if args.dtype is not None:
        overrides["dtype"] = _choice("--dtype", args.dtype, "KV_DTYPES")
    if args.attention is not None:
        overrides["attention"] = _choice("--attention", args.attention, "ATTENTION_PATHS")
    return overrides


def _copy_noise(text: str) -> float:
    # parsed here, not by argparse's type=float, so a bad value is one line, not usage + line
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise ConfigError(f"--copy-noise must be a number in 0..1, got {text!r}")
    return value


def _choice(flag: str, text: str, names: str) -> str:
    """`text` if it is one of `reference_engine.config.<names>`, else a one-line error."""
    from kvcanary.reference_engine import config

    valid = getattr(config, names)
    if text not in valid:
        raise ConfigError(f"{flag} must be one of {', '.join(valid)}, got {text!r}")
    return text


def _serve(args: argparse.Namespace) -> int:
    if not is_loopback(args.host) and not args.allow_remote:
        raise ConfigError(
            f"refusing to listen on non-loopback host {args.host!r}: the reference engine "
            "leaks other requests' data by design; pass --allow-remote to do it anyway"
        )
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    from kvcanary.reference_engine.availability import require_engine

    require_engine("kvcanary serve")
    from kvcanary.reference_engine.server.launch import make_config

    config = make_config(args.preset, args.fix, **_overrides(args))
    from kvcanary.reference_engine.model.attention_path import choose_attention

    attention = f"kvcanary serve: {choose_attention(config).line}"
    if args.processes:
        return _serve_processes(args, config, _summary(args, config), attention)
    return _serve_in_process(args, config, _summary(args, config), attention)


def _summary(args: argparse.Namespace, config: Any) -> str:
    """What the listening line says about the engine."""
    fixes = ",".join(sorted(config.fixes)) or "none"
    summary = f"preset {config.preset}, fixes {fixes}"
    if config.prefix_cache:
        summary += ", prefix cache on"
    if config.merge_prefill_usage:
        summary += ", router merges prefill's usage"
    if config.dtype != "float32":
        summary += f", {config.dtype} KV"
    if args.copy_noise is not None:
        summary += f", copy noise {config.copy_noise:g}"
    if config.transfer_bandwidth_bytes_per_s is not None:
        summary += f", KV link {config.transfer_bandwidth_bytes_per_s:g} bytes/s"
    return summary


def _serve_in_process(args: argparse.Namespace, config: Any, summary: str, attention: str) -> int:
    import uvicorn

    from kvcanary.reference_engine.server.app import build_app
    from kvcanary.reference_engine.server.launch import bind_socket, url_of

    sock = bind_socket(args.host, args.port)
    try:
        app = build_app(config)
    except (MemoryError, RuntimeError) as exc:  # torch's allocator: pools too large
        sock.close()
        raise ConfigError(
            f"cannot allocate the engine's KV pools ({config.prefill_pool_tokens} + "
            f"{config.decode_pool_tokens} tokens): {str(exc).splitlines()[0]}"
        ) from None
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    )
    print(f"kvcanary serve: listening on {url_of(sock)} ({summary}; one process)", flush=True)
    print(attention, flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
        server.run(sockets=[sock])
    return 0


def _serve_processes(args: argparse.Namespace, config: Any, summary: str, attention: str) -> int:
    from kvcanary.reference_engine.server.launch import ProcessCluster

    cluster = ProcessCluster(config, host=args.host, port=args.port, inherit_output=True)
    try:
        cluster.start()
        urls = {c.role: c.url for c in cluster.children}
        print(
            f"kvcanary serve: listening on {cluster.url} ({summary}; prefill {urls['prefill']} "
            f"with KV bootstrap port {cluster.bootstrap_port}, decode {urls['decode']})",
            flush=True,
        )
        print(attention, flush=True)
        while True:
            cluster.check_alive()
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        raise RunIncomplete(str(exc).splitlines()[0]) from None
    finally:
        cluster.stop()

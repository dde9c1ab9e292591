"""The option registry: every setting of every command and of the pytest plugin, as data.

`kvcanary run` / `soak` / `audit` / `repro`, the config file's `[run]` / `[soak]` tables and
the pytest plugin (`--kvcanary-` + `kvcanary run`'s, plus `suite`) take their options from
`OPTIONS`: spelling, type, default and help exist once; a scope that reads an option
differently has a `Variant`, not a second definition. It knows no precedence
(`harness.run.config`), no argparse (`option_flags`) and no value syntax (`option_values`).
"""

from __future__ import annotations

from kvcanary.harness.run.option_spec import PLUGIN_PREFIX as PLUGIN_PREFIX
from kvcanary.harness.run.option_spec import RUNS, Option, Scope, Variant, count, flag, urls
from kvcanary.harness.run.option_values import (
    MAX_BUDGET,
    MAX_CONCURRENCY,
    MAX_REQUESTS,
    MAX_TENANTS,
    MAX_TOKENS,
    float_within,
    int_within,
    parse_duration,
    parse_env_name,
    parse_port,
    parse_prices,
    parse_retention,
    parse_text,
    parse_url,
)
from kvcanary.harness.run.option_values import format_duration as format_duration  # one spelling

OPTIONS: tuple[Option, ...] = (
    Option(
        "target",
        parse_url,
        None,
        "Base URL of an OpenAI-compatible deployment. Without it, "
        "the bundled reference engine is started on a free loopback port.",
        metavar="URL",
        scopes=(*RUNS, "audit", "repro"),
        variants=(
            ("plugin", Variant("Base URL of an OpenAI-compatible deployment to test.")),
            ("audit", Variant("The deployment's base URL (its router, when disaggregated).")),
            ("repro", Variant("Run against this deployment instead of the scenario's target.")),
        ),
    ),
    Option(
        "model",
        parse_text,
        None,
        "Model name to send (default: the first model the target lists at /v1/models).",
        metavar="NAME",
        scopes=(*RUNS, "audit"),
    ),
    Option(
        "api",
        parse_text,
        "completions",
        "Endpoint: /v1/chat/completions (the template's size is measured first) or "
        "/v1/completions (the prompt is exactly what is counted).",
        metavar="chat|completions",
        choices=("chat", "completions"),
    ),
    count(
        "tenants",
        4,
        "Number of simulated tenants (2 to 256).",
        at_most=MAX_TENANTS,
        why=" (a canary names one of 256 tenants)",
    ),
    count(
        "requests",
        None,
        "Stop after N requests (default 60 when --duration is not given).",
        ("run", "plugin"),
        at_most=MAX_REQUESTS,
        why=" (a canary names one of 4,194,304 requests)",
    ),
    Option(
        "duration",
        parse_duration,
        None,
        "Stop after this long: 30s, 10m, 8h (required for soak).",
        metavar="D",
    ),
    count(
        "concurrency",
        None,
        "Closed loop: N requests in flight at all times (default without --rate: 8, or 1 "
        "for the bundled engine).",
        at_most=MAX_CONCURRENCY,
    ),
    Option(
        "rate",
        float_within(0.001, 100_000.0),
        None,
        "Open loop: Poisson arrivals at R requests per "
        "second, on an absolute clock (lateness is recorded as queue time).",
        metavar="R",
    ),
    count(
        "pool_tokens",
        None,
        "The target's KV pool size in tokens (default: ask the target).",
        (*RUNS, "audit"),
        at_most=MAX_TOKENS,
    ),
    count(
        "context_tokens",
        None,
        "The target's context length in tokens (default: ask the target).",
        (*RUNS, "audit"),
        at_most=MAX_TOKENS,
    ),
    count(
        "page_size",
        None,
        "KV page size in tokens: every window of this many prompt tokens holds a whole "
        "canary (default: the target's, else 16).",
        at_most=65_536,
    ),
    flag(
        "strict_page_size",
        "Refuse to run when a canary of the tokenizer is too long for every page to hold a "
        "whole one (default: lace as densely as it allows and say which window is guaranteed).",
    ),
    Option(
        "tokenizer",
        parse_text,
        "auto",
        "Tokenizer for exact prompt lengths: a tiktoken encoding name, a tokenizer.json path, "
        "`server` (the target's tokenize route) or `auto`: the target's own where it serves a "
        "tokenize route (vLLM, SGLang, llama.cpp), else cl100k_base. Calibration checks at two "
        "prompt lengths that it counts like the target, and stops the run (exit 2) when not.",
        metavar="NAME|server|auto|PATH",
    ),
    Option(
        "api_key_env",
        parse_env_name,
        None,
        "Name of the environment variable holding the "
        "API key (the key itself is never written anywhere).",
        metavar="VAR",
        scopes=(*RUNS, "audit", "repro"),
    ),
    Option(
        "profile",
        parse_text,
        "incident",
        "Workload profile: incident (victims fill the pool, probes from the pool past the "
        "context), limits (only the edges), below (nothing over the limit), race (large "
        "aborts, each followed by a small long-answer victim: the page-lifetime race).",
        metavar="NAME",
    ),
    Option(
        "seed",
        int_within(0, 2**64 - 1),
        None,
        "Seed for prompts and arrivals; given, it also derives the canary key, so the run "
        "can be reproduced (default: random and recorded; the canary key is then random "
        "and never written).",
        metavar="N",
    ),
    Option(
        "timeout",
        parse_duration,
        120.0,
        "Per-request timeout (a whole streamed response).",
        metavar="D",
        scopes=(*RUNS, "audit"),
        variants=(("audit", Variant("Per-request timeout, the probe included.", 30.0)),),
    ),
    Option(
        "health_timeout",
        parse_duration,
        10.0,
        "How long one poll of the target's /health route may take. A slow or failing route is "
        "recorded (journal: health_route_failed), never a reason to call the run "
        "inconclusive: whether the target serves is judged from its requests.",
        metavar="D",
    ),
    Option(
        "http_backend",
        parse_text,
        "aiohttp",
        "The client's HTTP I/O under the httpx API: aiohttp (fast at hundreds of streams) "
        "or httpx's own httpcore pool.",
        metavar="aiohttp|httpx",
        choices=("aiohttp", "httpx"),
    ),
    Option(
        "out",
        parse_text,
        None,
        "Output directory (default ./kvcanary-runs/<UTC timestamp>).",
        metavar="DIR",
        scopes=(*RUNS, "repro"),
    ),
    Option(
        "config",
        parse_text,
        None,
        "TOML config file with a [run] table (flags override it).",
        metavar="FILE.toml",
        in_file=False,
    ),
    flag(
        "keep_raw_evidence",
        "Keep response text verbatim in the journal "
        "and evidence (default: redacted to canary spans plus a hash).",
        scopes=(*RUNS, "repro"),
    ),
    Option(
        "engine_preset",
        parse_text,
        "vulnerable",
        "Preset of the bundled engine (used without --target): vulnerable (the incident), "
        "patched (the incident's pools, every fix on), hardened (pools cover the context) or "
        "race (the page-lifetime race; with --profile race).",
        metavar="vulnerable|patched|hardened|race",
        choices=("vulnerable", "patched", "hardened", "race"),
        variants=(
            (
                "plugin",
                Variant(
                    "Start the bundled reference engine with this preset for the session and "
                    "test it (instead of --kvcanary-target): a project's own engine patches "
                    "can be tested this way.",
                    default=None,
                    aliases=("engine",),
                ),
            ),
        ),
    ),
    Option(
        "engine_fix",
        parse_text,
        (),
        "Turn on one fix switch of the bundled engine (repeatable).",
        metavar="NAME",
        action="append",
    ),
    flag(
        "engine_prefix_cache",
        "Turn on the bundled engine's prefix cache (used without --target; shared by every "
        "tenant unless --engine-fix cache_salt or derive_cache_salt).",
    ),
    flag(
        "cache_probe",
        "Before the workload, run the cross-tenant prefix-cache timing probe (paired "
        "controls, KS and Mann-Whitney tests, Holm across tenant pairs): a "
        "shared_prefix_cache finding when one tenant is served from another's cache.",
        scopes=("run", "plugin"),
    ),
    count(
        "cache_probe_trials",
        20,
        "Timed trials per arm of the cache probe (more for noisy targets or small effects).",
        ("run", "plugin"),
        at_most=10_000,
    ),
    flag(
        "cache_probe_salts",
        "Give each tenant its own random cache_salt in the cache probe, which adds the "
        "spoofed-salt test (a tenant sending another tenant's salt).",
        scopes=("run", "plugin"),
    ),
    Option(
        "report_every",
        parse_duration,
        600.0,
        "Re-render the report this often.",
        metavar="D",
        scopes=("soak",),
    ),
    Option(
        "rotate_every",
        parse_duration,
        3600.0,
        "Start a new journal segment this often (the closed one is gzipped).",
        metavar="D",
        scopes=("soak",),
    ),
    Option(
        "keep_journal",
        parse_retention,
        None,
        "Delete closed journal segments older than AGE (24h) or beyond SIZE in all (20GB), "
        "oldest first, but never the first one nor one with a finding. Default: keep all.",
        metavar="AGE|SIZE",
        scopes=("soak",),
    ),
    flag(
        "force",
        "Resume into an --out whose journal belongs to a different target or seed.",
        scopes=("soak",),
    ),
    Option(
        "ray",
        parse_text,
        None,
        "Send the tenants' requests from Ray actors (one per tenant, each with its own HTTP "
        "client) on the Ray cluster at ADDRESS (ray://HOST:10001, HOST:6379 or auto); without "
        "ADDRESS, on a Ray instance started here. Needs kvcanary[ray].",
        metavar="ADDRESS",
        action="optional",
        const="local",
        scopes=("run", "soak"),
    ),
    count(
        "max_requests",
        None,
        "Cost guard: refuse a run that plans more than N requests; a soak stops cleanly "
        "before its (N+1)th.",
        at_most=MAX_BUDGET,
    ),
    count(
        "max_prompt_tokens",
        None,
        "Cost guard: refuse a run whose prompts add up to more than N tokens; a soak stops "
        "cleanly before it would send more.",
        at_most=MAX_BUDGET,
    ),
    Option(
        "price_per_mtok",
        parse_prices,
        None,
        "Price of a million prompt (IN) and completion (OUT) tokens, e.g. 0.15,0.60: the "
        "run's cost is printed and recorded in summary.json.",
        metavar="IN,OUT",
    ),
    Option(
        "max_cost",
        float_within(1e-9, 1e12),
        None,
        "Cost guard: refuse a run that could cost more than AMOUNT at --price-per-mtok "
        "(completions counted at their max_tokens); a soak stops before it would.",
        metavar="AMOUNT",
    ),
    flag(
        "yes",
        "Start a run although its plan exceeds --max-requests / --max-prompt-tokens / "
        "--max-cost; it then stops cleanly when the budget is spent.",
    ),
    Option(
        "keyring",
        parse_text,
        None,
        "Keep this run's canary key in FILE (created 0600; a group- or world-readable one is "
        "refused), under its key id, so a later run that meets this run's canary names its "
        "run, tenant, request and age. Off by default: without it no key is written.",
        metavar="FILE",
    ),
    Option(
        "metrics_port",
        parse_port,
        None,
        "Serve Prometheus metrics (requests, errors, findings by kind, TTFT histograms, "
        "target health) on this loopback port's /metrics (needs kvcanary[metrics]).",
        metavar="PORT",
        scopes=("soak",),
    ),
    flag(
        "suite",
        "Add kvcanary's built-in check suite (the incident checklist, 9 test items).",
        scopes=("plugin",),
    ),
    urls(
        "prefill",
        "A prefill server to read directly (repeatable; replaces the sides the target lists).",
    ),
    urls("decode", "A decode server to read directly (repeatable)."),
    flag("json", "Print the result as JSON.", scopes=("audit",)),
    flag(
        "probe",
        "Send one prompt just above the smallest pool through --target; accepting it is an "
        "unsafe_accept finding.",
        scopes=("audit",),
    ),
    Option(
        "param",
        parse_text,
        (),
        "Override a parameter the scenario declares (repeatable), e.g. --param pool_tokens=284928.",
        metavar="NAME=VALUE",
        action="append",
        scopes=("repro",),
    ),
)

OPTIONS_BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}


def options_for(scope: Scope) -> tuple[Option, ...]:
    """The options `scope` takes, as it reads them."""
    return tuple(option.in_scope(scope) for option in OPTIONS if scope in option.scopes)


__all__ = ["OPTIONS", "OPTIONS_BY_NAME", "PLUGIN_PREFIX", "Option", "Scope"]

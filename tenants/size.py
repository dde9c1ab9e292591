"""Prompt sizes written relative to the target's limits, and the outcome each size must get.

A size is an arithmetic expression over the target's limits, such as `0.5*pool`, `pool+1`,
`(pool+context)/2` or `4096`. Names:

    pool      the KV pool, in tokens (the smallest pool a request must fit: prefill's in PD)
    context   the advertised context length, in tokens
    page      the KV page size, in tokens
    limit     the tightest limit: longer prompts must be rejected (see `input_limit`)

Only numbers, those names, `+ - * /`, unary minus and parentheses are allowed; expressions
are parsed with `ast` and evaluated by walking the tree, never by `eval`. Results are
rounded down to whole tokens. This module knows nothing about prompts or tenants.

The expected outcome, when a spec does not fix one, is the safety rule the whole harness
applies: a prompt of `n` tokens must be rejected iff it exceeds a limit, `n > input_limit`;
`n == input_limit` is a boundary probe (either answer is defensible: a pool of `n` tokens
holds an `n`-token prompt, SGLang refuses `len(input_ids) >= max_req_input_len`), reported as
boundary behaviour and never a finding by itself. Below the limit, a prompt whose answer
cannot fit the context (`n + max_tokens > context`) is judged by the engine's documented
convention (`max_tokens_policy`): llama.cpp and vLLM answer until the context is full
(vLLM 0.32 caps max_tokens at what the context leaves), so it is expected `accept`; SGLang
and OpenAI refuse it with a 400, and an engine not identified may do either, so it is a
`boundary` (its answer recorded, never a finding by itself). The prompt fits every limit,
so it is never `reject`: accepting it is not the incident, and it is never a leak or an
`unsafe_accept` on its own.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Protocol

from kvcanary.canaries.errors import ConfigError
from kvcanary.tenants.plan import Expected, Intent

_NAMES = ("pool", "context", "page", "limit")
_MAX_EXPRESSION_CHARS = 200
_BINARY_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_UNARY_OPS = (ast.UAdd, ast.USub)
_ALLOWED_NODES = (
    ast.BinOp,
    ast.UnaryOp,
    ast.Constant,
    ast.Name,
    ast.Load,
    *_BINARY_OPS,
    *_UNARY_OPS,
)


class LimitsLike(Protocol):
    """What sizing needs from the target's limits (`harness.record.events.Limits` has it)."""

    @property
    def pool_tokens(self) -> int: ...

    @property
    def context_tokens(self) -> int: ...

    @property
    def page_size(self) -> int: ...

    @property
    def max_input_tokens(self) -> int | None: ...

    @property
    def max_tokens_policy(self) -> str | None:
        """`reject`, `stop` or None (unknown): what the engine does with a prompt that fits
        the context while prompt + max_tokens does not."""


def input_limit(limits: LimitsLike) -> int:
    """The tightest limit, `min(pool, context, max_input_tokens)`: a prompt longer than this
    must be rejected; one exactly this long is a boundary probe.

    A prompt of `n` tokens is served safely below it: its KV fits the pool and leaves room
    in the context for a generated token. At it, engines legitimately differ (a pool of `n`
    tokens holds the prompt; SGLang's `max_req_input_len` refuses `len(input_ids) >=` it
    with a 400), so neither answer is a finding.
    """
    limit = min(limits.pool_tokens, limits.context_tokens)
    if limits.max_input_tokens is not None:
        limit = min(limit, limits.max_input_tokens)
    return limit


_BY_POLICY: dict[str | None, Expected] = {"stop": "accept"}
"""A prompt that fits while its answer does not, by the engine's policy (else `boundary`)."""


def expected_outcome(num_tokens: int, limits: LimitsLike, max_tokens: int = 0) -> Expected:
    """`accept` below the target's input limit, `boundary` exactly at it, `reject` above;
    below it, a prompt whose `max_tokens` answer cannot fit the context is `accept` where
    the engine answers it until the context is full, else `boundary`."""
    limit = input_limit(limits)
    if num_tokens == limit:
        return "boundary"
    if num_tokens > limit:
        return "reject"
    if num_tokens + max_tokens > limits.context_tokens:
        return _BY_POLICY.get(limits.max_tokens_policy, "boundary")
    return "accept"


def check_expression(expr: str) -> ast.expr:
    """Parse a size expression, or raise ConfigError quoting it."""
    if len(expr) > _MAX_EXPRESSION_CHARS:
        raise ConfigError(f"size expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        raise ConfigError(f"size expression {expr!r} is not valid arithmetic") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in _NAMES:
            raise ConfigError(
                f"size expression {expr!r}: unknown name {node.id!r} (use {', '.join(_NAMES)})"
            )
        if not isinstance(node, _ALLOWED_NODES):
            raise ConfigError(
                f"size expression {expr!r}: only numbers, {', '.join(_NAMES)}, + - * / and "
                "parentheses are allowed"
            )
        if isinstance(node, ast.Constant) and (
            isinstance(node.value, bool) or not isinstance(node.value, int | float)
        ):
            raise ConfigError(f"size expression {expr!r}: {node.value!r} is not a number")
    return tree


def evaluate(expr: str, limits: LimitsLike) -> int:
    """The size in tokens (rounded down) of `expr` against `limits`; at least 1."""
    names = {
        "pool": limits.pool_tokens,
        "context": limits.context_tokens,
        "page": limits.page_size,
        "limit": input_limit(limits),
    }
    try:
        value = _walk(check_expression(expr), names)
    except ZeroDivisionError:
        raise ConfigError(f"size expression {expr!r} divides by zero") from None
    if not math.isfinite(value):
        raise ConfigError(f"size expression {expr!r} is not a finite number")
    num_tokens = math.floor(value)
    if num_tokens < 1:
        raise ConfigError(
            f"size expression {expr!r} resolves to {num_tokens} tokens for pool="
            f"{limits.pool_tokens}, context={limits.context_tokens}; a prompt needs at least 1"
        )
    return num_tokens


def _walk(node: ast.expr, names: dict[str, int]) -> float:
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int | float)
        return node.value
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.UnaryOp):
        operand = _walk(node.operand, names)
        return -operand if isinstance(node.op, ast.USub) else operand
    assert isinstance(node, ast.BinOp), "check_expression admits only these node types"
    left, right = _walk(node.left, names), _walk(node.right, names)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    return left / right


@dataclass(frozen=True, slots=True)
class SizeSpec:
    """A prompt size to plan, before the target's limits are known."""

    label: str
    expr: str
    intent: Intent
    expected: Expected | None = None
    """None: derived from the size by `expected_outcome` when resolved."""

    def __post_init__(self) -> None:
        check_expression(self.expr)

    def resolve(self, limits: LimitsLike, max_tokens: int = 0) -> ResolvedSize:
        """This size in tokens against `limits`, with its expected outcome for an answer of
        up to `max_tokens` tokens."""
        num_tokens = evaluate(self.expr, limits)
        expected = self.expected or expected_outcome(num_tokens, limits, max_tokens)
        return ResolvedSize(self.label, self.expr, self.intent, num_tokens, expected)


@dataclass(frozen=True, slots=True)
class ResolvedSize:
    """A size spec evaluated against one target's limits."""

    label: str
    expr: str
    intent: Intent
    num_tokens: int
    expected: Expected


def size(expr: str, intent: Intent, expected: Expected | None = None) -> SizeSpec:
    """A SizeSpec labelled by its own expression (the common case)."""
    return SizeSpec(label=expr.replace(" ", ""), expr=expr, intent=intent, expected=expected)

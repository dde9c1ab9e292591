"""Which tokenizer counts a run's prompts when none is named (`--tokenizer auto`): the
target's own where it serves a tokenize route, a local one that gives the same ids, or the
fallback against a target without a route, each said in one line."""

from __future__ import annotations

import json

import pytest
from recorded_targets import Handler, RecordedTarget, Reply, Seen, mock_client
from word_tokenizer import WordTokenizer

from kvcanary.canaries import RemoteTokenizer, Tokenizer
from kvcanary.canaries.errors import ConfigError
from kvcanary.harness.target.tokenizer import (
    FALLBACK_TOKENIZER,
    ServerTokenizer,
    choose_tokenizer,
    local_tokenizer_name,
)
from kvcanary.tenants.tenant import Tenant

BASE = "http://target"
TENANT = Tenant(name="tenant-0")


def tokenize(shift: int) -> dict[str, Handler]:
    """vLLM's `/tokenize`: one token per word, ids from `shift` (0: WordTokenizer's ids)."""

    def answer(seen: Seen) -> Reply:
        ids = [shift + i for i in range(len(json.loads(seen.body)["prompt"].split()))]
        return 200, "application/json", json.dumps({"tokens": ids, "count": len(ids)}).encode()

    return {"POST /tokenize": answer}


async def chosen(
    routes: dict[str, Handler], *, local: WordTokenizer | None, auto: bool
) -> tuple[Tokenizer, RemoteTokenizer | None, list[str], RecordedTarget]:
    target = RecordedTarget(routes)
    notes: list[str] = []
    async with mock_client({"target": target}) as http:
        tokenizer, remote = await choose_tokenizer(
            http, BASE, "m", TENANT, local=local, auto=auto, note=notes.append
        )
    return tokenizer, remote, notes, target


def test_auto_loads_the_fallback_and_server_loads_nothing() -> None:
    assert local_tokenizer_name("auto") == FALLBACK_TOKENIZER == "cl100k_base"
    assert local_tokenizer_name("server") is None
    assert local_tokenizer_name("/models/x/tokenizer.json") == "/models/x/tokenizer.json"


async def test_a_target_with_a_tokenize_route_counts_with_its_own() -> None:
    tokenizer, remote, notes, _ = await chosen(tokenize(shift=7), local=WordTokenizer(), auto=True)
    assert isinstance(tokenizer, ServerTokenizer)
    assert remote is not None
    (note,) = notes
    assert note.startswith("tokenizer: the target's own, http://target/tokenize (vllm);")


async def test_a_local_tokenizer_giving_the_routes_ids_counts_without_requests() -> None:
    local = WordTokenizer()
    tokenizer, remote, notes, _ = await chosen(tokenize(shift=0), local=local, auto=True)
    assert tokenizer is local
    assert remote is not None  # still used where it renders the chat template
    assert notes == [
        "tokenizer: words, which counts as the target's own http://target/tokenize (vllm) does"
    ]


async def test_a_target_without_a_route_is_counted_with_the_fallback() -> None:
    local = WordTokenizer()
    tokenizer, remote, notes, target = await chosen({}, local=local, auto=True)
    assert (tokenizer, remote) == (local, None)
    assert notes[0].startswith("tokenizer: words (the target serves no tokenize route;")
    assert {seen.path for seen in target.seen} == {"/v1/tokenize", "/tokenize"}


async def test_a_named_tokenizer_is_used_as_named_and_server_needs_a_route() -> None:
    local = WordTokenizer()
    tokenizer, remote, notes, target = await chosen(tokenize(0), local=local, auto=False)
    assert (tokenizer, remote, notes, target.seen) == (local, None, [], [])
    with pytest.raises(ConfigError, match="--tokenizer server: http://target has no usable"):
        await chosen({}, local=None, auto=False)

"""Canary-laced prompts for hand-written tests, and an index that finds the canaries again.

The `kvcanary_canaries` fixture hands one `CanaryFactory` to a test session: the session's
minter (seeded by --kvcanary-seed, else a random key), its tokenizer (--kvcanary-tokenizer)
and page size, so a test can build a prompt of exactly N tokens for a tenant, send it any
way it likes, and ask whose canaries a response contains. Canaries are spelled with the
tokenizer's alphabet (`canaries.alphabet`); where the page size is too small for them,
prompts are laced for `guarantee.window` (`canaries.guarantee`).

It deliberately knows nothing about targets, transport or findings: classification into
findings is the content detector's job in real runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvcanary.canaries import (
    BuiltPrompt,
    CanaryError,
    CanaryIndex,
    CanaryMinter,
    Hit,
    Owner,
    Tokenizer,
    build_prompt,
    load_tokenizer,
)
from kvcanary.canaries.alphabet import alphabet_for
from kvcanary.canaries.errors import ConfigError
from kvcanary.canaries.guarantee import page_guarantee
from kvcanary.tenants.planner import request_id
from kvcanary.tenants.tenant import Tenant

DEFAULT_PAGE_SIZE = 16


class CanaryFactory:
    """Mints, builds and recognises the canaries of one test session."""

    def __init__(
        self,
        tenants: Sequence[Tenant],
        tokenizer: Tokenizer,
        minter: CanaryMinter,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
        strict_page_size: bool = False,
    ) -> None:
        assert tenants, "a canary factory needs at least one tenant"
        self.tenants = tuple(tenants)
        self.tokenizer = tokenizer
        self.minter = minter
        self.page_size = page_size
        try:
            self.guarantee = page_guarantee(
                minter.num_tokens(tokenizer), page_size, strict=strict_page_size
            )
        except CanaryError as exc:
            raise ConfigError(f"--kvcanary-page-size {page_size}: {exc}") from None
        self.index = CanaryIndex(minter)
        self._numbers = itertools.count()

    @classmethod
    def create(
        cls,
        tenants: Sequence[Tenant],
        *,
        tokenizer: str,
        seed: int | None,
        page_size: int | None,
        strict_page_size: bool = False,
    ) -> CanaryFactory:
        """A factory from the session's settings; `ConfigError` for an unusable tokenizer."""
        if tokenizer == "server":
            raise ConfigError(
                "kvcanary_canaries needs a local tokenizer (a tiktoken name or a "
                "tokenizer.json path), not --kvcanary-tokenizer=server"
            )
        if tokenizer == "auto":  # no target to ask here: `auto`'s own fallback
            from kvcanary.harness.target.tokenizer import FALLBACK_TOKENIZER

            tokenizer = FALLBACK_TOKENIZER
        try:
            loaded = load_tokenizer(tokenizer)
        except CanaryError as exc:
            raise ConfigError(f"--kvcanary-tokenizer {tokenizer}: {exc}") from None
        alphabet = alphabet_for(loaded)
        minter = (
            CanaryMinter.random(alphabet=alphabet)
            if seed is None
            else CanaryMinter.from_seed(seed, "pytest", alphabet=alphabet)
        )
        return cls(
            tenants,
            loaded,
            minter,
            page_size=page_size or DEFAULT_PAGE_SIZE,
            strict_page_size=strict_page_size,
        )

    def prompt(self, num_tokens: int, *, tenant: int = 0) -> BuiltPrompt:
        """A prompt of exactly `num_tokens` tokens laced with `tenant`'s fresh canaries.

        Every call is a new request number, so no two prompts share a canary; the canaries
        join the factory's index, owned by (tenant name, request id).
        """
        if not 0 <= tenant < len(self.tenants):
            raise ConfigError(f"tenant must be 0..{len(self.tenants) - 1}, got {tenant}")
        number = next(self._numbers)
        try:
            built = build_prompt(
                self.tokenizer,
                self.minter,
                tenant=tenant,
                request=number,
                num_tokens=num_tokens,
                page_size=self.guarantee.window,
                seed=number,
            )
        except CanaryError as exc:
            raise ConfigError(f"cannot build a {num_tokens}-token prompt: {exc}") from None
        owner = Owner(self.tenants[tenant].name, request_id(tenant, number))
        self.index.add_many((span.text, owner) for span in built.canaries)
        return built

    def scan(self, text: str) -> list[Hit]:
        """Every canary found in `text`, whole, normalised or as a long enough fragment."""
        return self.index.scan(text)

    def owners(self, text: str) -> set[Owner]:
        """Whose canaries `text` contains (canaries minted by this factory only)."""
        return {hit.owner for hit in self.scan(text) if hit.owner is not None}

"""Canary-laced prompts for engine tests, and who owns the canaries an answer contains.

Prompts come from `canaries.build_prompt` (every page-sized window holds a complete canary),
as token ids of exactly the requested length; answers are scanned with a `CanaryIndex`.
A "foreign" owner is any request other than the one that got the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary.canaries import CanaryIndex, CanaryMinter, Owner, Tokenizer, build_prompt


@dataclass(frozen=True, slots=True)
class Prompt:
    rid: str
    input_ids: list[int]
    canaries: tuple[str, ...]


class Canaries:
    def __init__(self, tokenizer: Tokenizer, seed: int = 0, page_size: int = 16) -> None:
        self.tokenizer = tokenizer
        self.page_size = page_size
        self.minter = CanaryMinter.from_seed(seed, "reference-engine-tests")
        self.index = CanaryIndex(self.minter)
        self._num_prompts = 0

    def prompt(self, rid: str, num_tokens: int, tenant: int = 0) -> Prompt:
        """A prompt of exactly `num_tokens` ids laced with `rid`'s canaries."""
        self._num_prompts += 1
        built = build_prompt(
            self.tokenizer,
            self.minter,
            tenant=tenant,
            request=self._num_prompts,
            num_tokens=num_tokens,
            page_size=self.page_size,
        )
        ids = self.tokenizer.encode(built.text)
        assert len(ids) == num_tokens
        for span in built.canaries:
            self.index.add(span.text, Owner(str(tenant), rid))
        return Prompt(rid, ids, tuple(span.text for span in built.canaries))

    def owners(self, text: str) -> set[str]:
        """Request ids whose live canaries appear in `text`."""
        return {hit.owner.request_id for hit in self.index.scan(text) if hit.owner is not None}

    def foreign(self, text: str, own: str) -> set[str]:
        return self.owners(text) - {own}

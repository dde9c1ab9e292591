"""What a run can promise about its pages: the window in which a complete canary is certain.

A prompt laced for page size P holds a complete canary in every window of P tokens only
if a canary of c tokens satisfies 2c - 1 <= P (see `canaries.prompt`). In a coarse
vocabulary (a byte-level model: 46-token canaries) no page size of ordinary engines meets
that. Rather than refuse, a run laces as densely as the tokenizer allows, i.e. for the
window W = max(P, 2c - 1), and says so: "every 91-token window holds a complete canary;
pages of 16 tokens are not individually attributable". A leaked page is then still
caught wherever W consecutive leaked tokens show up; a single leaked page may not name its
owner. `--strict-page-size` makes the weaker promise an error instead.

This module knows the arithmetic and the wording only, not how canaries are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcanary.canaries.errors import CanaryError
from kvcanary.canaries.records import field_record


@dataclass(frozen=True, slots=True)
class PageGuarantee:
    """The declared page size, the longest canary, and the window prompts are laced for."""

    page_size: int
    canary_tokens: int
    window: int
    """Every `window` consecutive prompt tokens hold a complete canary (>= page_size)."""

    @property
    def per_page(self) -> bool:
        """Whether every page of `page_size` tokens holds a complete canary."""
        return self.window == self.page_size

    def sentence(self) -> str:
        """The promise, in one line (for the progress display and the report)."""
        if self.per_page:
            return f"every {self.page_size}-token page holds a complete canary"
        return (
            f"every {self.window}-token window holds a complete canary; pages of "
            f"{self.page_size} tokens are not individually attributable "
            f"(a canary takes {self.canary_tokens} tokens in this tokenizer)"
        )

    def to_dict(self) -> dict[str, Any]:
        """What the journal and summary.json record."""
        return field_record(
            self,
            renamed={"window": "guaranteed_window"},
            per_page=self.per_page,
            guarantee=self.sentence(),
        )


def page_guarantee(canary_tokens: int, page_size: int, *, strict: bool = False) -> PageGuarantee:
    """The guarantee for canaries of `canary_tokens` at `page_size`; with `strict`, a
    `CanaryError` when pages cannot each hold a complete canary."""
    if page_size < 1:
        raise CanaryError(f"page size must be positive, got {page_size}")
    window = max(page_size, 2 * canary_tokens - 1)
    if strict and window != page_size:
        raise CanaryError(
            f"page size {page_size}: a canary takes {canary_tokens} tokens in this tokenizer, "
            f"so only pages of at least {window} tokens each hold a complete one"
        )
    return PageGuarantee(page_size, canary_tokens, window)

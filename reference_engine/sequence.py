"""One request as a side's scheduler sees it (nano-vllm's Sequence), torch-free.

What it knows: the prompt this side will process (`origin_input_ids`, which the vulnerable
intake path swaps for a one-token placeholder), the client's own prompt length, generated
tokens, the request's pages in this side's pool (the leading ones possibly the prefix cache's),
its cache salt and tenant key, its KVPoll state and how it finished. The
deferred abort (`to_finish`) is SGLang's: set at intake, promoted only when something checks.

What it does not know: KV contents, tensors, or which queue holds it (the schedulers do).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcanary.reference_engine.finish import FinishAbort
from kvcanary.reference_engine.interfaces import FinishOut, GenerateRequest, KVPoll, TransferStatus

PLACEHOLDER_INPUT_IDS = [0]
"""SGLang's `set_finish_with_abort`: "set it to one token to skip the long prefill"."""


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    room: int
    origin_input_ids: list[int]
    max_new_tokens: int
    num_client_tokens: int
    """What the client sent; `origin_input_ids` may since have become the placeholder."""
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    """Block table: this side's pages, in logical order."""
    page_generations: list[int] = field(default_factory=list)
    """Each page's allocation generation when this request got it (its owner tag)."""
    to_finish: FinishAbort | None = None
    finished: FinishOut | None = None
    poll: KVPoll = KVPoll.BOOTSTRAPPING
    cache_salt: str | None = None
    tenant_key: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefill side's prefix cache (its leading pages)."""
    # prefill side
    num_computed_tokens: int = 0
    num_ready_pages: int = 0
    """Pages whose KV is complete and may be sent."""
    dst_page_ids: tuple[int, ...] = ()
    # decode side
    num_reserved_pages: int = 0
    """Pages set aside for tokens not yet generated (admission budget)."""
    transfer_status: TransferStatus | None = None
    registered: bool = False
    """Decode has published its metadata for the room (a transfer may be in flight)."""

    @classmethod
    def from_request(cls, req: GenerateRequest) -> Req:
        return cls(
            rid=req.rid,
            room=req.bootstrap_room,
            origin_input_ids=list(req.input_ids),
            max_new_tokens=req.max_new_tokens,
            num_client_tokens=len(req.input_ids),
            cache_salt=req.cache_salt,
            tenant_key=req.tenant_key,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.origin_input_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finished is not None

    def set_finish_with_abort(self, abort: FinishAbort) -> None:
        """SGLang: swap the prompt for a one-token placeholder and defer the abort."""
        self.origin_input_ids = list(PLACEHOLDER_INPUT_IDS)
        self.to_finish = abort

    def finish(self, out: FinishOut) -> None:
        assert self.finished is None, f"{self.rid} finished twice"
        self.finished = out

    def finish_abort(self, abort: FinishAbort) -> None:
        self.finish(abort.finish_out(self.num_prompt_tokens, len(self.output_ids)))
        self.poll = KVPoll.FAILED

"""Intake checks, in SGLang's two layers, shared by both sides (each with its own pool).

1. TokenizerManager, against the advertised context: an immediate 400, no scheduler involved.
2. Scheduler `validate_input_length`, against the side's own `max_req_input_len`
   (min(context - 1, pool - 1) - 5): the pool can lower it below the context, and this is the
   check whose rejection the vulnerable engine defers (see `sequence.Req.set_finish_with_abort`).
3. The PD queues' own capacity check against the pool size (`exceeds_kv_capacity`), which
   looks at whatever `origin_input_ids` holds by then.

What it does not decide: what happens to a rejected request; that is the schedulers' job.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcanary.reference_engine import finish
from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.finish import FinishAbort


@dataclass(frozen=True, slots=True)
class SideLimits:
    """One side's limits: the context both sides advertise, and this side's pool."""

    context_length: int
    pool_tokens: int
    max_req_input_len: int

    @classmethod
    def of(cls, config: EngineConfig, pool_tokens: int) -> SideLimits:
        return cls(config.context_length, pool_tokens, config.max_req_input_len(pool_tokens))

    def check_context(self, num_input: int, max_new_tokens: int) -> FinishAbort | None:
        """TokenizerManager's check (layer 1)."""
        if num_input >= self.context_length:
            return finish.input_longer_than_context(num_input, self.context_length)
        if num_input + max_new_tokens > self.context_length:
            return finish.total_longer_than_context(num_input, max_new_tokens, self.context_length)
        return None

    def validate_input_length(self, num_input: int) -> FinishAbort | None:
        """Scheduler's check (layer 2), SGLang's `validate_input_length`."""
        if num_input >= self.max_req_input_len:
            return finish.input_length_exceeds(num_input, self.max_req_input_len)
        return None

    def check_capacity(self, rid: str, num_tokens: int) -> FinishAbort | None:
        """PD queue's `_check_if_req_exceed_kv_capacity` (layer 3)."""
        if num_tokens > self.pool_tokens:
            return finish.exceeds_kv_capacity(rid, num_tokens, self.pool_tokens)
        return None

"""Building the sides, and the in-process engine with mini_lb's semantics.

`build_prefill` / `build_decode` are what the HTTP layer calls, one per server (in one process
or two). `DisaggregatedEngine` puts both sides and an `InProcessTransfer` in one event loop
and answers as SGLang's mini_lb router does: the same request goes to both sides concurrently,
the client sees decode's status and tokens, and prefill's own answer is recorded next to it
(the vulnerable engine's prefill says 200 with prompt_tokens=1 for the incident's prompt).

What it does not do: HTTP, tokenizing prompts (requests carry token ids; `engine.tokenizer`
is exposed for callers), or choosing a bootstrap room policy beyond a random 63-bit id.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from types import TracebackType

from kvcanary.reference_engine.config import EngineConfig
from kvcanary.reference_engine.decode import DecodeServer
from kvcanary.reference_engine.interfaces import (
    FinishOut,
    GenerateRequest,
    HeadOut,
    TokenOut,
    TransferBackend,
)
from kvcanary.reference_engine.model_runner import ModelRunner
from kvcanary.reference_engine.prefill import PrefillServer
from kvcanary.reference_engine.tokenizer import Tokenizer, load_tokenizer
from kvcanary.reference_engine.transfer import InProcessTransfer


def build_prefill(config: EngineConfig, transfer: TransferBackend) -> PrefillServer:
    """The prefill server (not started: `await side.start()` inside the serving loop)."""
    vocab_size = load_tokenizer(config.tokenizer).vocab_size
    return PrefillServer(
        config, transfer, ModelRunner(config, vocab_size, config.prefill_pool_tokens)
    )


def build_decode(config: EngineConfig, transfer: TransferBackend) -> DecodeServer:
    """The decode server (not started)."""
    tokenizer = load_tokenizer(config.tokenizer)
    runner = ModelRunner(config, tokenizer.vocab_size, config.decode_pool_tokens)
    return DecodeServer(config, transfer, runner, tokenizer)


def new_room() -> int:
    """A bootstrap room id as mini_lb draws it."""
    return random.getrandbits(63)


@dataclass(frozen=True, slots=True)
class EngineResult:
    """What the client of the router sees (decode's answer), plus prefill's own answer."""

    rid: str
    status: int
    token_ids: tuple[int, ...]
    text: str
    finish: FinishOut
    """Decode's FinishOut: what reaches the client."""
    prefill_finish: FinishOut
    """Prefill's FinishOut (mini_lb reads it only to merge logprobs)."""
    ttft_s: float | None
    """Seconds from submission to the first token, if any."""


class DisaggregatedEngine:
    """Prefill + decode + in-process transfer in one event loop, behind mini_lb's semantics."""

    def __init__(self, config: EngineConfig, transfer: TransferBackend | None = None) -> None:
        self.config = config
        if transfer is None:
            transfer = InProcessTransfer(
                bandwidth_bytes_per_s=config.transfer_bandwidth_bytes_per_s
            )
        self.transfer = transfer
        self.prefill = build_prefill(config, self.transfer)
        self.decode = build_decode(config, self.transfer)
        self._prefill_calls: set[asyncio.Task[FinishOut]] = set()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.decode.tokenizer

    async def start(self) -> None:
        await self.prefill.start()
        await self.decode.start()

    async def stop(self) -> None:
        await self.decode.stop()
        await self.prefill.stop()
        for call in list(self._prefill_calls):
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await call
        await self.transfer.close()

    async def __aenter__(self) -> DisaggregatedEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def request(self, rid: str, input_ids: list[int], max_new_tokens: int) -> GenerateRequest:
        """A request as the router forwards it (with a fresh bootstrap room)."""
        return GenerateRequest(rid, tuple(input_ids), max_new_tokens, bootstrap_room=new_room())

    async def generate(self, req: GenerateRequest) -> EngineResult:
        """Send `req` to both sides; answer with decode's result (mini_lb).

        Cancelling this call is a client disconnect: decode's stream is closed (decode aborts)
        and prefill is told to abort; prefill's call still runs to its end, as a request
        already sent to a server does.
        """
        started = time.perf_counter()
        prefill_answer = asyncio.create_task(self.prefill.generate(req), name=f"lb-{req.rid}")
        self._prefill_calls.add(prefill_answer)
        prefill_answer.add_done_callback(self._prefill_calls.discard)
        tokens: list[TokenOut] = []
        ttft_s: float | None = None
        decode_finish: FinishOut | None = None
        try:
            async for event in self.decode.generate(req):
                if isinstance(event, FinishOut):
                    decode_finish = event
                    break
                if isinstance(event, HeadOut):
                    continue  # an HTTP stream's head; the result is the tokens and the finish
                if ttft_s is None:
                    ttft_s = time.perf_counter() - started
                tokens.append(event)
            prefill_finish = await asyncio.shield(prefill_answer)
        except asyncio.CancelledError:
            await self.prefill.abort(req.rid)
            raise
        assert decode_finish is not None, "decode ended without a FinishOut"
        return EngineResult(
            rid=req.rid,
            status=decode_finish.status,
            token_ids=tuple(t.token_id for t in tokens),
            text="".join(t.text for t in tokens),
            finish=decode_finish,
            prefill_finish=prefill_finish,
            ttft_s=ttft_s,
        )

    async def abort(self, rid: str) -> None:
        """The client went away: both servers abort (decode first, as its stream breaks)."""
        await self.decode.abort(rid)
        await self.prefill.abort(rid)

    def num_allocated_pages(self) -> int:
        return self.prefill.num_allocated_pages() + self.decode.num_allocated_pages()

    def transfer_is_idle(self) -> bool:
        """No room is open in the in-process transfer (always True for other backends)."""
        return not isinstance(self.transfer, InProcessTransfer) or self.transfer.num_open_rooms == 0

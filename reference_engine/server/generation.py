"""One request's bridge to a side: its events as a queue, and its abort.

A `Generation` runs `side.generate(req)` in its own task, so the HTTP handler can wait for
the next event and for the client's disconnect at the same time. Prefill answers with one
`FinishOut`; decode yields at most one `HeadOut` (a stream's head may go out), tokens and
then one `FinishOut`; both look the same here.
`abort()` is the client-disconnect path into the engine (SGLang's tokenizer manager aborts
a request whose connection closed): it calls `side.abort(rid)` unless the request already
finished, then stops the pump. `DisconnectWatcher` notices `http.disconnect` while a
handler is still waiting for the engine, before any response byte has been sent.

This module knows the seams in `reference_engine.interfaces`, not HTTP response shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, Literal, TypeVar, cast

from kvcanary.reference_engine.interfaces import (
    AnySide,
    DecodeSide,
    FinishOut,
    GenerateRequest,
    PrefillSide,
    SideEvent,
)

Role = Literal["prefill", "decode"]
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while the handler was waiting."""


def side_events(side: AnySide, role: Role, req: GenerateRequest) -> AsyncIterator[SideEvent]:
    """The side's answer as events: prefill's single FinishOut, or decode's stream."""
    if role == "decode":
        return cast(DecodeSide, side).generate(req)

    async def prefill_answer() -> AsyncIterator[SideEvent]:
        yield await cast(PrefillSide, side).generate(req)

    return prefill_answer()


class Generation:
    """`side.generate(req)` running in a task; events are read with `next_event()`."""

    def __init__(self, side: AnySide, role: Role, req: GenerateRequest) -> None:
        self.side = side
        self.req = req
        self.finished = False
        self._aborted = False
        self._events: asyncio.Queue[SideEvent | BaseException] = asyncio.Queue()
        self._pump = asyncio.create_task(
            self._run(side_events(side, role, req)), name=f"generate-{role}-{req.rid}"
        )

    async def _run(self, events: AsyncIterator[SideEvent]) -> None:
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    self._events.put_nowait(event)
        except Exception as exc:  # handed to the reader, who owns the response
            self._events.put_nowait(exc)

    async def next_event(self) -> SideEvent:
        """The next token or the finish; raises what the side raised."""
        assert not self.finished, "read past the FinishOut"
        item = await self._events.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if isinstance(item, FinishOut):
            self.finished = True
        return item

    async def abort(self) -> None:
        """Tell the side to abort (once, and only if the request has not finished)."""
        if not self.finished and not self._aborted:
            self._aborted = True
            await self.side.abort(self.req.rid)
        await self.close()

    async def close(self) -> None:
        """Stop the pump task (after a finish this only reaps it)."""
        if not self._pump.done():
            self._pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class DisconnectWatcher:
    """Watches `receive()` for `http.disconnect` until stopped."""

    def __init__(self, receive: Receive) -> None:
        self._task = asyncio.create_task(self._watch(receive))

    @staticmethod
    async def _watch(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def race(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`; raise `ClientGone` if the client disconnects first."""
        work = asyncio.ensure_future(awaitable)
        await asyncio.wait({work, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise ClientGone

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

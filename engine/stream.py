"""Per-request event channel from the scheduler thread to an asyncio gRPC handler."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamEvent:
    kind: str  # "tokens" | "finish" | "error"
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    finish_reason: str = ""
    message: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # usage / timings on "finish"


class ReqChannel:
    """Thread-safe producer side (scheduler thread) of an asyncio.Queue owned by a handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.closed = False

    def put(self, event: StreamEvent) -> None:
        if self.closed:
            return
        if event.kind in ("finish", "error"):
            self.closed = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    async def get(self) -> StreamEvent:
        return await self.queue.get()

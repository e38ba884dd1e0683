"""Run several request flows at once (n > 1, batched prompts) as one merged event stream.

`prime()` waits until every flow produced its first event (or ended), so errors that happen
before any output (validation, no workers, failed after the retry) become one HTTP error
instead of a half-written stream. After that a flow only ends with an error *event*.

One flow (the common case: n = 1, one prompt) is read in place by whoever reads the fan-out,
without a task and a queue between: per token that hop cost as much as the rest of the
router's streaming path. Several flows each run in a task feeding one queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from pdserve.router.errors import RouterError, UpstreamFailed
from pdserve.router.events import FlowEvent

_END = object()
log = logging.getLogger(__name__)


def _as_router_error(e: Exception) -> RouterError:
    if isinstance(e, RouterError):
        return e
    log.exception("request flow failed", exc_info=e)  # a bug must end the stream, not hang it
    return RouterError(f"internal error: {type(e).__name__}")


class FanOut:
    def __init__(self, streams: list[AsyncIterator[FlowEvent]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num = len(streams)
        self._single = streams[0] if len(streams) == 1 else None
        self._tasks = [] if self._single is not None else [
            asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]
        self._buffer: list[tuple[int, FlowEvent]] = []
        self._ended: set[int] = set()

    async def _pump(self, index: int, stream: AsyncIterator[FlowEvent]) -> None:
        ended = False
        try:
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    self._queue.put_nowait((index, event))
            ended = True
            self._queue.put_nowait((index, _END))
        except Exception as e:
            ended = True
            self._queue.put_nowait((index, _as_router_error(e)))
        finally:
            if not ended:  # cancelled (by close(), or from below): the reader must not hang
                self._queue.put_nowait((index, UpstreamFailed(
                    "the request was cancelled inside the router", code="cancelled")))

    async def _next(self) -> tuple[int, object]:
        item = await self._queue.get()
        if isinstance(item[1], RouterError):
            raise item[1]
        return item

    async def _next_single(self) -> FlowEvent | None:
        """The single flow's next event, None at its end; its errors as RouterError."""
        try:
            return await anext(self._single)  # type: ignore[arg-type]
        except StopAsyncIteration:
            return None
        except Exception as e:
            raise _as_router_error(e) from None

    async def prime(self) -> None:
        """Raise the first RouterError of any flow before it has produced output."""
        if self._single is not None:
            try:
                first = await self._next_single()
            except BaseException:
                await self.close()
                raise
            if first is None:
                self._ended.add(0)
            else:
                self._buffer.append((0, first))
            return
        started: set[int] = set()
        try:
            while len(started) < self._num:
                index, item = await self._next()
                started.add(index)
                if item is _END:
                    self._ended.add(index)
                else:
                    self._buffer.append((index, item))
        except BaseException:
            await self.close()
            raise

    async def events(self) -> AsyncIterator[tuple[int, FlowEvent]]:
        for item in self._buffer:
            yield item
        self._buffer.clear()
        if self._single is not None:
            while not self._ended:
                event = await self._next_single()
                if event is None:
                    self._ended.add(0)
                else:
                    yield 0, event
            return
        while len(self._ended) < self._num:
            index, item = await self._next()
            if item is _END:
                self._ended.add(index)
            else:
                yield index, item

    async def close(self) -> None:
        """Cancel what still runs; each flow's cleanup sends its Aborts."""
        if self._single is not None:
            if not getattr(self._single, "ag_running", False):  # else its task closes it
                await self._single.aclose()  # type: ignore[attr-defined]
            return
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

"""The streamed answer of a completion or chat completion: Server-Sent Events, one `data:` line
per chunk, as the OpenAI API sends them.

Chat streams open with an empty assistant delta per choice. A chunk goes out for each event
with text, a finish reason or (when asked for) logprobs; a worker's failure becomes an error
event and the stream goes on with the other choices; the usage chunk (when asked for) and
`data: [DONE]` close it. The fan-out is closed however the stream ends (client gone included),
which aborts whatever still runs on the workers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from json.encoder import encode_basestring as _str  # json.dumps' string form (non-ASCII kept)
from typing import Any

from starlette.responses import Response

from pdserve.router import openai_format as fmt
from pdserve.router.errors import RouterError
from pdserve.router.fanout import FanOut
from pdserve.router.http.errors import error_body

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache")]


class EventStream(Response):
    """An ASGI response sending `chunks` as they come, stopped when the client goes away (its
    `http.disconnect` cancels the sending task); `close` runs however it ends (the fan-out's
    close: what still runs on the workers is aborted, even if `chunks` never started).
    Starlette's StreamingResponse does the same under ASGI 2.3 with an anyio task group and
    cancel scopes per request, ~8% of the router loop's CPU per request in a profile; here it
    is one watcher task and a cancel."""

    def __init__(self, chunks: AsyncGenerator[str, None],
                 close: Callable[[], Awaitable[None]]) -> None:  # no super(): no body
        self.chunks, self.close = chunks, close
        self.status_code, self.background, self.raw_headers = 200, None, list(_HEADERS)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        gone = False

        async def _watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            if task is not None:
                task.cancel()

        watch = asyncio.ensure_future(_watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk.encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise  # cancelled from outside (shutdown): not ours to swallow
            if task is not None:
                task.uncancel()
        finally:
            watch.cancel()
            try:
                await self.chunks.aclose()
            finally:
                await self.close()


# Line breaks that json.dumps keeps as they are (it escapes those below U+0020) but that
# str.splitlines, and clients reading SSE with it (httpx's aiter_lines), break lines at: escaped,
# so that every event is one line for them too (the JSON is the same).
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _one_line(event: str) -> str:
    return event if event.isascii() else event.translate(_LINE_BREAKS)


def _data(obj: dict) -> str:
    return _one_line(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n")


class TextChunks:
    """The stream's text chunks without logprobs (nearly all of them), written from a prefix
    made once per stream: byte for byte what `_data` makes of fmt.chat_chunk /
    fmt.completion_chunk (a test compares them), for a fraction of json.dumps's cost."""

    def __init__(self, rid: str, created: int, model: str, chat: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.chat = chat
        self.head = _one_line(
            f'data: {{"id": {_str(rid)}, "object": "{obj}", "created": {int(created)}, '
            f'"model": {_str(model)}, "choices": [{{"index": ')

    def chunk(self, index: int, text: str, finish_reason: str | None) -> str:
        reason = _str(finish_reason) if finish_reason is not None else "null"
        if self.chat:
            body = f'"delta": {{"content": {_one_line(_str(text))}}}' if text else '"delta": {}'
        else:
            body = f'"text": {_one_line(_str(text))}'
        return (f'{self.head}{index}, {body}, "logprobs": null, "finish_reason": {reason}}}]}}'
                "\n\n")


async def sse_stream(fan: FanOut, choices: list[fmt.ChoiceState], rid: str, created: int,
                     model: str, chat: bool, want_lp: bool,
                     include_usage: bool) -> AsyncIterator[str]:
    fast = TextChunks(rid, created, model, chat)
    try:
        if chat:
            for c in choices:
                yield _data(fmt.chat_chunk(rid, created, model, c.index,
                                           {"role": "assistant", "content": ""}, None, False))
        try:
            async for index, event in fan.events():
                choice = choices[index]
                choice.add(event)
                if event.error is not None:
                    yield _data(error_body(event.error, "server_error", code="worker_failed"))
                    continue
                if not (event.text or event.finish_reason or (want_lp and event.logprobs)):
                    continue
                if not (want_lp and event.logprobs):
                    choice.emitted_chars += len(event.text)
                    yield fast.chunk(index, event.text, event.finish_reason)
                elif chat:
                    delta = {"content": event.text} if event.text else {}
                    yield _data(fmt.chat_chunk(rid, created, model, index, delta, event, want_lp))
                else:
                    yield _data(fmt.completion_chunk(rid, created, model, choice, event, want_lp))
        except RouterError as e:
            yield _data(e.to_openai())
        if include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield _data(fmt.usage_chunk(rid, created, model, obj, choices))
        yield "data: [DONE]\n\n"
    finally:
        await fan.close()

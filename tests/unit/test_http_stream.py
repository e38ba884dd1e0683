"""bench/http_stream.py against a real asyncio HTTP server on loopback: chunked and sized
bodies, lines split across chunks, keep-alive reuse, a kept-alive connection the server closed,
`Connection: close`, and errors for what is not HTTP."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.bench.http_stream import HttpStreamPool


class Server:
    """Answers each request on a connection with the next canned reply; counts connections
    and keeps the request bodies."""

    def __init__(self, replies: list[bytes], close_after: int | None = None) -> None:
        self.replies, self.close_after = replies, close_after
        self.connections, self.bodies = 0, []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(h.split(b":")[1] for h in head.split(b"\r\n")
                             if h.lower().startswith(b"content-length")))
                self.bodies.append(json.loads(await reader.readexactly(n)))
                writer.write(self.replies.pop(0))
                await writer.drain()
                served += 1
                if self.close_after is not None and served >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body


async def _run(server: Server, fn):
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    pool = HttpStreamPool(f"http://127.0.0.1:{port}", {"Authorization": "Bearer k"})
    try:
        return await fn(pool)
    finally:
        await pool.close()
        srv.close()
        await srv.wait_closed()


async def _lines(pool: HttpStreamPool, payload: dict) -> tuple[int, list[str]]:
    resp, conn = await pool.post("/v1/completions", payload)
    try:
        return resp.status, [line async for line in resp.lines()]
    finally:
        pool.release(resp, conn)


def test_chunked_lines_across_chunks_and_keep_alive_reuse() -> None:
    sse = chunked(b'data: {"a"', b': 1}\n\ndata: {"b": 2}\n', b"\ndata: [DONE]\n\n")
    sized = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\n{\"e\": \"no\"}"
    server = Server([sse, sized, sse])

    async def go(pool: HttpStreamPool):
        return [await _lines(pool, {"n": i}) for i in range(3)]

    got = asyncio.run(_run(server, go))
    want = ["data: {\"a\": 1}", "", "data: {\"b\": 2}", "", "data: [DONE]", ""]
    assert got == [(200, want), (400, ['{"e": "no"}']), (200, want)]
    assert server.connections == 1 and server.bodies == [{"n": 0}, {"n": 1}, {"n": 2}]


def test_a_connection_closed_while_idle_is_replaced_and_close_is_honoured() -> None:
    sse = chunked(b"data: x\n\n")
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbye"
    server = Server([sse, sse, closing, sse], close_after=1)  # the server drops each one

    async def go(pool: HttpStreamPool):
        out = [await _lines(pool, {"n": 0})]
        await asyncio.sleep(0.05)  # the server closed the kept-alive connection meanwhile
        out.append(await _lines(pool, {"n": 1}))
        out.append(await _lines(pool, {"n": 2}))
        assert not pool._idle  # `Connection: close`: not kept
        out.append(await _lines(pool, {"n": 3}))
        return out

    got = asyncio.run(_run(server, go))
    assert [s for s, _ in got] == [200] * 4 and got[2][1] == ["bye"]
    assert server.bodies == [{"n": i} for i in range(4)]  # each request sent exactly once
    assert server.connections == 4


def test_not_http_and_bad_urls_are_errors() -> None:
    with pytest.raises(ValueError, match="http://host"):
        HttpStreamPool("https://example.com")
    server = Server([b"SSH-2.0-nope\r\n\r\n"])
    with pytest.raises(ValueError, match="status line"):
        asyncio.run(_run(server, lambda pool: _lines(pool, {})))

"""A lean HTTP/1.1 client for `pdserve bench`'s requests: keep-alive connections over asyncio
streams, a JSON body out, the status, headers and body lines back (chunked or sized bodies).

The bench's load generator is one process and one event loop carrying every client; through
httpx each request cost that loop a few milliseconds of CPU (request and response objects,
its transport layers), so at 256 clients the generator, not the server, set the pace of each
wave's new requests (docs/performance.md, "Serving path"). Plain `http://` only: other URLs
go through httpx (serve_client.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class StaleConnection(OSError):
    """A kept-alive connection the server had closed before our request reached it."""


class Response:
    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader
                 ) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self.complete = False  # the whole body was read: the connection may be reused
        self.keep_alive = headers.get("connection", "").lower() != "close"

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (without their line ends), to its end."""
        rest = b""
        async for data in self._chunks():
            rest += data
            *full, rest = rest.split(b"\n")
            for line in full:
                yield line.rstrip(b"\r").decode()
        if rest:
            yield rest.rstrip(b"\r").decode()

    async def read(self) -> bytes:
        return b"".join([d async for d in self._chunks()])

    async def _chunks(self) -> AsyncIterator[bytes]:
        r = self._reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await r.readline()).split(b";")[0].strip() or b"x", 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                data = await r.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in self.headers:
            n = int(self.headers["content-length"])
            if n:
                yield await r.readexactly(n)
        else:  # to the end of the connection
            self.keep_alive = False
            while data := await r.read(1 << 16):
                yield data
        self.complete = True


class HttpStreamPool:
    """Keep-alive connections to one `http://host:port` (idle ones reused, new ones opened as
    needed: as many as requests in flight)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"base_url: {base_url!r} is not an http://host[:port] URL")
        self.host, self.port, self.prefix = u.hostname, u.port or 80, u.path.rstrip("/")
        self._head = f"Host: {u.netloc}\r\nContent-Type: application/json\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, payload: Any) -> tuple[Response, Any]:
        """POST `payload` as JSON; (the response, a handle to give back to `release`) once the
        status and headers came. A connection the server closed while idle is retried once."""
        body = json.dumps(payload).encode()
        req = (f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        while True:
            reused = bool(self._idle)
            reader, writer = self._idle.pop() if reused else await asyncio.open_connection(
                self.host, self.port)
            try:
                writer.write(req)
                await writer.drain()
                resp = await _read_head(reader, reused)
            except OSError:  # StaleConnection, or a reset of an idle one: a fresh connection
                writer.close()
                if reused:
                    continue
                raise
            except BaseException:
                writer.close()
                raise
            return resp, (reader, writer)

    def release(self, resp: Response, conn: Any) -> None:
        """Back to the pool when its body was read to the end, else closed."""
        if resp.complete and resp.keep_alive:
            self._idle.append(conn)
        else:
            conn[1].close()

    async def close(self) -> None:
        for _, w in self._idle:
            w.close()
        self._idle.clear()


async def _read_head(reader: asyncio.StreamReader, reused: bool) -> Response:
    line = await reader.readline()
    if not line:
        if reused:
            raise StaleConnection("kept-alive connection closed by the server")
        raise ConnectionError("the server closed the connection before answering")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {line[:80]!r}")
    headers: dict[str, str] = {}
    while (h := await reader.readline()) not in (b"\r\n", b"\n"):
        if not h:
            raise ConnectionError("the connection closed inside the response headers")
        k, _, v = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return Response(int(parts[1]), headers, reader)

"""RouterServer: the gRPC server and the HTTP gateway of one router, on one asyncio loop.

    server = RouterServer(config)            # or RouterServer(config, tokenizer=tok)
    await server.start()                     # binds; server.http_port / server.grpc_port
    ...
    await server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import grpc
import uvicorn

from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.http import create_app
from pdserve.router.service import start_grpc_server

log = logging.getLogger(__name__)

# Idle keep-alive connections stay open longer than clients keep them pooled (httpx, and so the
# OpenAI client, expire theirs after 5 s; uvicorn's default is also 5 s): with equal timeouts a
# client may reuse a connection the server is just closing, and the request fails.
KEEP_ALIVE_S = 65


class RouterServer:
    def __init__(self, config: RouterConfig, tokenizer: Any = None) -> None:
        self.config = config
        self.core = RouterCore.build(config, tokenizer)
        self.http_port = 0
        self.grpc_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task | None = None

    @property
    def ready_line(self) -> str:
        host = self.config.host
        return f"router ready http=http://{host}:{self.http_port} grpc={host}:{self.grpc_port}"

    async def start(self) -> None:
        cfg = self.config
        await self.core.start()
        self._grpc, self.grpc_port = await start_grpc_server(self.core, cfg.host, cfg.grpc_port)
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.http_port))
        except OSError as e:
            sock.close()
            await self.stop()
            raise OSError(f"http_port: cannot bind {cfg.host}:{cfg.http_port}: {e}") from e
        self.http_port = sock.getsockname()[1]
        uv_config = uvicorn.Config(create_app(self.core), log_level="warning", lifespan="off",
                                   access_log=False, timeout_graceful_shutdown=2,
                                   timeout_keep_alive=KEEP_ALIVE_S)
        self._http = uvicorn.Server(uv_config)
        # The embedding program owns signals (uvicorn would re-raise them after shutdown).
        self._http.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        self._http_task = asyncio.ensure_future(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()  # raises what stopped it
                raise RuntimeError("http server exited before it started")
            await asyncio.sleep(0.01)

    async def wait(self) -> None:
        """Serve until the HTTP server exits (a signal, or `stop()`)."""
        if self._http_task is not None:
            await self._http_task

    def request_stop(self) -> None:
        """Ask `wait()` to return (signal handlers call this); a second call cuts the open
        connections at once instead of letting them finish."""
        if self._http is not None:
            if self._http.should_exit:
                self._http.force_exit = True
            self._http.should_exit = True

    async def stop(self) -> None:
        if self._http is not None:
            self._http.should_exit = True
        if self._http_task is not None:
            await asyncio.gather(self._http_task, return_exceptions=True)
            self._http_task = None
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
            self._grpc = None
        await self.core.stop()

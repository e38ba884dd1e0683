"""NIXL as the nixl backend uses it: the wheel built for this CUDA major, one agent per engine
with its UCX plugin, and the thread that collects a receiver's notifications.

NIXL ships per CUDA major (`nixl-cu12`, `nixl-cu13`, module `nixl_cu12` / `nixl_cu13`; the
`nixl` meta package picks one). The agent runs without NIXL's progress thread: that thread
polls without pause (measured here: 0.92 s of CPU per idle second, a whole core), and both
sides drive progress themselves anyway: the sender while it waits for its WRITE, the receiver
in NotifPoller.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.kvtransfer.backends import nixl_module_name

log = logging.getLogger("pdserve.kvtransfer")

WARMUP = b"PDKV-HELLO"  # notification sent at handshake to set the connection up; ignored


def _api() -> Any:
    name = nixl_module_name()
    if name is None:
        raise ImportError("backend: 'nixl' needs NIXL (pip install 'pdserve[nixl]', or "
                          "'pdserve[nixl-cu13]' with CUDA 13)")
    mod = importlib.import_module(name)
    if not hasattr(mod, "nixl_agent"):  # the meta package keeps the API in _api
        mod = importlib.import_module(f"{name}._api")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        # NIXL logs every agent and backend it creates at INFO, to stdout.
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return mod


def new_agent(name: str) -> Any:
    """A NIXL agent with the UCX plugin and no progress thread."""
    api = _api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                       backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError(f"nixl: the UCX plugin did not start (plugins: "
                           f"{agent.get_plugin_list()})")
    return agent


class NotifPoller:
    """Receiver side: one thread calling `agent.get_new_notifs()` (which also progresses the
    agent's UCX worker) and `on_message(msg)` for each notification, in arrival order.

    It polls every 0.1 ms for 50 ms after a notification (a request's chunks come close
    together) and every 1 ms otherwise: ~1% of a core while idle, at most 1 ms added to a
    request's first chunk."""

    FAST_S, SLOW_S, BUSY_WINDOW_S = 1e-4, 1e-3, 0.05

    def __init__(self, agent: Any, on_message: Callable[[bytes], None]) -> None:
        self._agent = agent
        self._on_message = on_message
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-nixl-notify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = 0.0
        while not self._stop.is_set():
            try:
                notifs = self._agent.get_new_notifs()
            except Exception as e:  # noqa: BLE001 - keep serving the other peers
                log.warning("nixl: reading notifications failed: %s", e)
                notifs = {}
            for msgs in notifs.values():
                last = time.monotonic()
                for msg in msgs:
                    try:
                        self._on_message(bytes(msg))
                    except Exception:
                        log.exception("nixl: chunk notification dropped")
            busy = time.monotonic() - last < self.BUSY_WINDOW_S
            self._stop.wait(self.FAST_S if busy else self.SLOW_S)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

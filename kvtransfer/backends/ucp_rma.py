"""One-sided UCX writes (RMA) through libucp, on the context and endpoints that ucxx made.

ucxx's Python binding has no memory handle, remote key or put, but it exposes the raw UCP
handles of its context (`core._ctx.context.handle`) and of each endpoint (`ep._ep.handle`),
and its worker runs in UCS_THREAD_MODE_MULTI, so the few calls a one-sided write needs go to
libucp directly through ctypes:

- receiver: `PoolMapping` (`ucp_mem_map` of the pool, `ucp_rkey_pack`): the packed remote key,
  sent to the sender with the pool's base address;
- sender: `RemoteKey` (`ucp_ep_rkey_unpack` on the endpoint to the receiver), `put` (one
  `ucp_put_nbx` per run of pages, its request released at once), `flush`
  (`ucp_ep_flush_nbx`: done once every put of the endpoint has landed at the receiver) and
  `pointer` (`ucp_rkey_ptr`: the receiver's memory mapped here, where UCX can map it).

A request is polled here (`Request.done`), progressing the worker as it does: ucxx's
progress thread sleeps until the worker's next event, which a put's completion may not raise.
Loading fails with a clear error where libucp or a symbol is missing (`available()` says
whether it works here).
"""

from __future__ import annotations

import ctypes
import glob
import os
from functools import cache
from typing import Any

import torch

UCS_INPROGRESS = 1
ERR_LAST = -100  # UCS status codes lie in (ERR_LAST, 0]
_FIRST_ERROR_PTR = (1 << 64) + ERR_LAST + 1  # an error status as a pointer (unsigned) is above
MAP_ADDRESS, MAP_LENGTH, MAP_MEMORY_TYPE = 1 << 0, 1 << 1, 1 << 4
MEMORY_HOST, MEMORY_CUDA = 0, 1  # ucs_memory_type_t
_VP = ctypes.c_void_p


class _MemMapParams(ctypes.Structure):  # ucp_mem_map_params_t
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", _VP),
                ("length", ctypes.c_size_t), ("flags", ctypes.c_uint), ("prot", ctypes.c_uint),
                ("memory_type", ctypes.c_int), ("exported_memh_buffer", _VP)]


# ucp_request_param_t with op_attr_mask 0 (no callback, bytes, memory type detected); larger
# than the struct of any libucp version
_NO_PARAMS = ctypes.create_string_buffer(256)

_SIGNATURES = [
    ("ucp_mem_map", ctypes.c_int, [_VP, ctypes.POINTER(_MemMapParams), ctypes.POINTER(_VP)]),
    ("ucp_mem_unmap", ctypes.c_int, [_VP, _VP]),
    ("ucp_rkey_pack", ctypes.c_int, [_VP, _VP, ctypes.POINTER(_VP),
                                     ctypes.POINTER(ctypes.c_size_t)]),
    ("ucp_rkey_buffer_release", None, [_VP]),
    ("ucp_ep_rkey_unpack", ctypes.c_int, [_VP, ctypes.c_char_p, ctypes.POINTER(_VP)]),
    ("ucp_rkey_destroy", None, [_VP]),
    ("ucp_rkey_ptr", ctypes.c_int, [_VP, ctypes.c_uint64, ctypes.POINTER(_VP)]),
    ("ucp_put_nbx", _VP, [_VP, _VP, ctypes.c_size_t, ctypes.c_uint64, _VP, _VP]),
    ("ucp_ep_flush_nbx", _VP, [_VP, _VP]),
    ("ucp_request_check_status", ctypes.c_int, [_VP]),
    ("ucp_request_free", None, [_VP]),
    ("ucp_worker_progress", ctypes.c_uint, [_VP]),
]


@cache
def libucp() -> ctypes.CDLL:
    """libucp as ucxx loaded it (the copy in its wheel's tree first), its signatures set."""
    import ucxx

    root = os.path.dirname(os.path.dirname(ucxx.__file__))
    found = sorted(glob.glob(os.path.join(root, "**", "libucp.so*"), recursive=True))
    lib = ctypes.CDLL(found[0] if found else "libucp.so")
    for name, res, args in _SIGNATURES:
        fn = getattr(lib, name)  # AttributeError: a libucp without RMA
        fn.restype, fn.argtypes = res, args
    return lib


def available() -> str | None:
    """None when one-sided writes can be made here, else why not."""
    try:
        libucp()
    except (ImportError, OSError, AttributeError) as e:
        return f"libucp RMA unavailable: {e}"
    return None


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"ucx: {what} failed (UCS status {status})")


def _status_of(ptr: int | None) -> int | None:
    """A ucs_status_ptr_t: its status when it is one (0: done at once), None for a request."""
    if not ptr:
        return 0
    signed = ctypes.c_int64(ptr).value
    return signed if ERR_LAST < signed < 0 else None


def _context() -> int:
    from ucxx import core

    return int(core._ctx.context.handle)


def _worker() -> int:
    from ucxx import core

    return int(core._ctx.worker.handle)


class PoolMapping:
    """The receiver's pool mapped for remote writes; `info` is what a sender needs."""

    def __init__(self, pool: torch.Tensor) -> None:
        lib, self._ctx = libucp(), _context()
        nbytes = pool.numel() * pool.element_size()
        params = _MemMapParams(MAP_ADDRESS | MAP_LENGTH | MAP_MEMORY_TYPE, pool.data_ptr(),
                               nbytes, 0, 0, MEMORY_CUDA if pool.is_cuda else MEMORY_HOST,
                               None)
        self._memh = _VP()
        check(lib.ucp_mem_map(self._ctx, ctypes.byref(params), ctypes.byref(self._memh)),
              "ucp_mem_map of the pool")
        buf, size = _VP(), ctypes.c_size_t()
        try:
            check(lib.ucp_rkey_pack(self._ctx, self._memh, ctypes.byref(buf),
                                    ctypes.byref(size)), "ucp_rkey_pack")
        except RuntimeError:
            self.close()
            raise
        rkey = ctypes.string_at(buf, size.value)
        lib.ucp_rkey_buffer_release(buf)
        self.info = {"rkey": rkey.hex(), "base": int(pool.data_ptr()),
                     "num_pages": int(pool.shape[0]),
                     "page_bytes": int(pool[0].numel() * pool.element_size())}

    def close(self) -> None:
        if self._memh:
            check(libucp().ucp_mem_unmap(self._ctx, self._memh), "ucp_mem_unmap")
            self._memh = _VP()


class RemoteKey:
    """A receiver's packed key unpacked on one endpoint (valid while the endpoint lives)."""

    def __init__(self, ep: Any, rkey_hex: str) -> None:
        self._endpoint = ep
        self.ep = int(ep._ep.handle)
        self._key = _VP()
        check(libucp().ucp_ep_rkey_unpack(self.ep, bytes.fromhex(rkey_hex),
                                          ctypes.byref(self._key)), "ucp_ep_rkey_unpack")

    def pointer(self, remote: int) -> int | None:
        """A local address of the remote `remote` (`ucp_rkey_ptr`), where UCX can map the
        receiver's memory into this process (shared memory; on GPUs, its CUDA IPC handle
        opened on the current device), else None."""
        out = _VP()
        if libucp().ucp_rkey_ptr(self._key, remote, ctypes.byref(out)) != 0 or not out.value:
            return None
        return int(out.value)

    @property
    def closed(self) -> bool:
        """The endpoint closed (the peer went away): its handle must not be used."""
        return bool(self._endpoint.closed)

    def put(self, runs: list[tuple[int, int, int]]) -> None:
        """Start one write per (local address, bytes, remote address); a later `flush` says
        when they landed. The loop is this module's hot path (one call per page of a
        scattered room), so it binds what it calls once and tests the status pointer inline."""
        lib = libucp()
        put_nbx, free, ep, key = lib.ucp_put_nbx, lib.ucp_request_free, self.ep, self._key
        for local, nbytes, remote in runs:
            ptr = put_nbx(ep, local, nbytes, remote, key, _NO_PARAMS)
            if ptr:  # None: done at once
                if ptr >= _FIRST_ERROR_PTR:
                    check(ctypes.c_int64(ptr).value, "ucp_put_nbx")
                free(ptr)  # a request: UCX completes it and releases it then

    def flush(self) -> Request:
        """The endpoint's flush: done once every write started before it has landed."""
        return Request(libucp().ucp_ep_flush_nbx(self.ep, _NO_PARAMS), "ucp_ep_flush_nbx")

    def close(self) -> None:
        if self._key:
            libucp().ucp_rkey_destroy(self._key)
            self._key = _VP()


class Request:
    """An operation's status pointer: poll `done()` (raises on failure) until True."""

    def __init__(self, ptr: int | None, what: str) -> None:
        self._ptr, self._what, self._worker = ptr, what, _worker()
        status = _status_of(ptr)
        self._done = status is not None
        if status is not None:
            check(status, what)

    def done(self) -> bool:
        """Progresses the worker once (as ucxx's progress thread does; it may be asleep until
        the worker's next event), then checks."""
        if self._done:
            return True
        lib = libucp()
        lib.ucp_worker_progress(self._worker)
        status = lib.ucp_request_check_status(self._ptr)
        if status == UCS_INPROGRESS:
            return False
        lib.ucp_request_free(self._ptr)
        self._done = True
        check(status, self._what)
        return True

    def release(self) -> None:
        """Give up on it (a timeout): UCX frees the request once it completes."""
        if not self._done:
            libucp().ucp_request_free(self._ptr)
            self._done = True

"""The backend for a (prefill, decode) pair follows from where the peer is: every branch of
hosts.choose_backend and of decode's offer, the host identity and its overrides, and the
staged pieces the ucx backend cuts a chunk into."""

from __future__ import annotations

import argparse
import random

import numpy as np
import pytest
import torch

from pdserve.kvtransfer import AuxData, TransferConfig
from pdserve.kvtransfer.backends.staging import (
    GPU_PIECE_BYTES,
    HOST_PIECE_BYTES,
    IN_FLIGHT,
    MIN_SPLIT_BYTES,
    copy_index,
    gather,
    message_bytes,
    one_run,
    piece_bytes,
    scatter,
    split,
    warm_copies,
)
from pdserve.kvtransfer.chunk_header import ChunkHeader
from pdserve.kvtransfer.config import add_transfer_args, transfer_config_from_args
from pdserve.kvtransfer.descriptors import DST, NUM, POS, SRC, merge_runs, run_pages
from pdserve.kvtransfer.hosts import choose_backend, host_id, machine_id, offers_for

A, B = "node-a/boot-1", "node-b/boot-2"
EVERYTHING = ["shm", "cuda_ipc", "nixl", "ucx", "tcp"]


def _all_usable(name: str) -> str | None:
    return None


def _without(*names: str):  # type: ignore[no-untyped-def]
    return lambda name: "not installed on prefill" if name in names else None


@pytest.mark.parametrize(("offers", "prefill", "decode", "usable", "expected"), [
    (["shm", "nixl", "ucx", "tcp"], A, A, _all_usable, "shm"),  # CPU pool, one host
    (["cuda_ipc", "nixl", "ucx", "tcp"], A, A, _all_usable, "cuda_ipc"),  # GPU pool, one host
    (["shm", "nixl", "ucx", "tcp"], A, B, _all_usable, "nixl"),
    (["cuda_ipc", "nixl", "ucx", "tcp"], A, B, _all_usable, "nixl"),
    (["cuda_ipc", "nixl", "ucx", "tcp"], A, B, _without("nixl"), "ucx"),
    (["shm", "ucx", "tcp"], A, B, _all_usable, "ucx"),  # decode has no NIXL
    (["shm", "nixl", "ucx", "tcp"], A, B, _without("nixl", "ucx"), "tcp"),
    (["cuda_ipc", "nixl", "tcp"], A, A, _without("cuda_ipc"), "nixl"),  # prefill on the CPU
    (["tcp"], A, A, _all_usable, "tcp"),
])
def test_auto_picks_by_host(offers: list[str], prefill: str, decode: str, usable,  # type: ignore
                            expected: str) -> None:
    choice = choose_backend(offers, "auto", prefill, decode, usable)
    assert choice.backend == expected
    assert ("same host" if prefill == decode else "different hosts") in choice.reason
    if prefill != decode and "shm" in offers:
        assert "shm: needs prefill and decode on one host" in choice.reason


@pytest.mark.parametrize(("offers", "configured"), [
    (["shm", "nixl", "tcp"], "shm"),  # prefill pinned to shm, decode on another host
    (["shm"], "auto"),  # decode pinned to shm
    (["cuda_ipc"], "cuda_ipc"),
])
def test_a_pinned_same_host_backend_across_hosts_is_refused_naming_both(
        offers: list[str], configured: str) -> None:
    choice = choose_backend(offers, configured, A, B, _all_usable)
    assert choice.backend == ""
    assert choice.reason.startswith("backend: no usable backend")
    assert repr(A) in choice.reason and repr(B) in choice.reason
    assert "needs prefill and decode on one host" in choice.reason


def test_pinned_backend_is_used_or_refused() -> None:
    assert choose_backend(EVERYTHING, "tcp", A, A, _all_usable).backend == "tcp"
    refused = choose_backend(["nixl", "tcp"], "ucx", A, B, _all_usable)
    assert refused.backend == "" and "ucx: decode does not offer it" in refused.reason
    failed = choose_backend(["nixl"], "nixl", A, B, lambda n: "connecting failed: reset")
    assert failed.backend == "" and "connecting failed: reset" in failed.reason


def test_decode_offers_its_same_host_path_then_what_it_can_run() -> None:
    def has(*names: str):  # type: ignore[no-untyped-def]
        return lambda n: n in names

    assert offers_for("auto", True, False, has("nixl", "ucx")) == ["shm", "nixl", "ucx", "tcp"]
    assert offers_for("auto", False, True, has("ucx")) == ["cuda_ipc", "ucx", "tcp"]
    assert offers_for("auto", False, False, has()) == ["tcp"]
    assert offers_for("nixl", True, False, has()) == ["nixl"]


def test_host_identity_and_its_override() -> None:
    assert host_id() == machine_id() and "/" in machine_id()
    assert host_id("rack7-node3") == "rack7-node3"
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    add_transfer_args(p)
    assert transfer_config_from_args(p.parse_args([])).host_id == ""
    assert transfer_config_from_args(p.parse_args(["--host-id", "rack7"])).host_id == "rack7"
    with pytest.raises(ValueError, match="host_id"):
        TransferConfig(host_id=" padded ")
    with pytest.raises(ValueError, match="stage_bytes"):
        TransferConfig(stage_bytes=-1)


def test_pieces_cover_the_pages_in_order_and_only_the_last_carries_aux() -> None:
    rng = random.Random(3)
    src, dst = rng.sample(range(1, 200), 40), rng.sample(range(1, 200), 40)
    d = np.concatenate([merge_runs(src, dst, pos=0, max_pages=4),
                        merge_runs(range(300, 310), range(400, 410), pos=40)])  # a 10-page run
    aux = AuxData(7, -1.5, 3)
    pieces = split(ChunkHeader(9, 2, d, True, aux), page_bytes=100, max_bytes=350)
    assert len(pieces) == -(-50 // 3)  # 3 pages each (350 bytes), the long run cut
    got = np.concatenate([p.descs for p in pieces])
    for col in (SRC, DST, POS):  # page by page, the same pages at the same positions
        assert np.array_equal(run_pages(got, col), run_pages(d, col))
    for p in pieces:
        assert p.descs[:, NUM].sum() * 100 <= 350 and p.descs.dtype == np.int64
        assert (p.room, p.seq) == (9, 2)
    assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert [p.aux for p in pieces] == [None] * (len(pieces) - 1) + [aux]
    not_last = split(ChunkHeader(9, 0, d, False, None), 100, 350)
    assert not any(p.last for p in not_last)
    empty = ChunkHeader(9, 3, d[:0], True, aux)
    assert split(empty, 100, 350) == [empty]
    assert len(split(ChunkHeader(9, 4, d, True, None), 100, 1)) == 50  # at least a page each


def test_gpu_chunks_go_as_messages_in_flight_together() -> None:
    pool = torch.empty(65536, 1024, dtype=torch.uint8)  # 1 KiB pages, 64 MiB in all
    page, mib = 1024, 1 << 20
    assert message_bytes(pool, 0, 4 * mib) == HOST_PIECE_BYTES  # host: the fixed size
    assert message_bytes(pool, 0, 4 * mib, gpu=True) == GPU_PIECE_BYTES  # small: whole
    big = IN_FLIGHT * MIN_SPLIT_BYTES + page  # a page over: halves, rounded up to pages
    assert message_bytes(pool, 0, big, gpu=True) == (MIN_SPLIT_BYTES // page + 1) * page
    assert message_bytes(pool, 0, 4 * GPU_PIECE_BYTES, gpu=True) == GPU_PIECE_BYTES
    assert message_bytes(pool, 3 * page, big, gpu=True) == 3 * page  # configured wins
    assert message_bytes(pool, 0, big, contiguous=True, gpu=True) == GPU_PIECE_BYTES  # whole


def test_gather_then_scatter_moves_exactly_the_pages() -> None:
    pool = torch.randn(64, 2, 2, 4, 1, 8).to(torch.bfloat16)
    rng = random.Random(5)
    src, dst = rng.sample(range(1, 64), 20), rng.sample(range(1, 64), 20)
    d = merge_runs(src, dst)
    stage = torch.empty(32, *pool.shape[1:], dtype=pool.dtype)
    got = gather(pool, d, stage)
    assert torch.equal(got.view(torch.int16), pool[src].view(torch.int16))
    out = torch.zeros_like(pool)
    scatter(got, out, d)
    assert torch.equal(out[dst].view(torch.int16), pool[src].view(torch.int16))
    untouched = sorted(set(range(64)) - set(dst))
    assert not out[untouched].view(torch.int16).any()
    assert one_run(np.array([4, 5, 6])) and not one_run(np.array([4, 6]))
    assert piece_bytes(pool, 0) == pool.numel() * 2  # capped by the pool
    assert piece_bytes(pool, 1) == pool[0].numel() * 2  # at least a page
    before = pool.clone()
    warm_copies(pool, stage)  # reads the pool, writes only the staging rows
    assert torch.equal(pool.view(torch.int16), before.view(torch.int16))
    assert torch.equal(stage[0].view(torch.int16), pool[0].view(torch.int16))


@pytest.mark.parametrize("n", [1, 2, 7, 128])
def test_copy_index_rows_are_the_pages_and_both_16_byte_aligned(n: int) -> None:
    """Triton compiles a kernel per pointer alignment: the second row of a [2, n] index
    must start aligned for odd n too, or a one-page warm-up compiles another kernel than a
    room's copies use."""
    src, dst = np.arange(n, dtype=np.int64) * 3, np.arange(n, dtype=np.int64) + 5
    idx = copy_index(src, dst, torch.device("cpu"))
    assert idx.shape == (2, n) and idx[1].is_contiguous()
    assert idx[0].tolist() == src.tolist() and idx[1].tolist() == dst.tolist()
    assert (idx[1].data_ptr() - idx[0].data_ptr()) % 16 == 0

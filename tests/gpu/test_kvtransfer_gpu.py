"""KV transfer between two processes with GPU pools (runs on the GPU machine; skipped without
CUDA): cuda_ipc in every copy mode; ucx on one GPU with UCX free to pick its transports and
forced through the host as a cross-host TCP link would be (UCX_TLS=tcp,cuda_copy), by
one-sided puts and staged in several messages; nixl where its wheel is installed. Timings are
kvbench's (first room against the later ones), not asserted here."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.kv_peer import PeerProcess, PoolSpec, make_pool, page_checksum, wait_for
from pdserve.kvtransfer import KVManager, KVPoll, TransferConfig
from pdserve.kvtransfer.backends import importable

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BASE = {"num_pages": 64, "num_layers": 4, "page_size": 16, "num_kv_heads": 2, "head_dim": 64}
# A few runs, then 20 pages of which no two are consecutive on either side.
SRC = [3, 4, 5, 9, 20, *range(21, 61, 2)]
DST = [40, 41, 42, 7, 8, *range(62, 43, -2), *range(38, 19, -2)]


def _send_three_chunks(prefill: PeerProcess, room: int) -> None:
    assert prefill.call("wait", room, int(KVPoll.WaitingForInput), 60)[0] == 2
    prefill.call("send", room, SRC[:2], 0, False, None)
    prefill.call("send", room, SRC[2:5], 2, False, None)
    prefill.call("send", room, SRC[5:], 5, True, (3, -0.1, 0))


@pytest.mark.parametrize("ipc_copy", ["auto", "triton", "staged"])
def test_cuda_ipc_pages_arrive_bit_exact(ipc_copy: str) -> None:
    """A few runs (peer copies, or the kernel with "triton"), then a chunk of scattered pages
    (the Triton page-to-page kernel, or gather / peer copy / scatter with "staged")."""
    cfg = TransferConfig(backend="cuda_ipc", ipc_copy=ipc_copy)
    last = torch.cuda.device_count() - 1
    prefill = PeerProcess("prefill", PoolSpec(**BASE, seed=5, device="cuda:0"), cfg)
    spec = PoolSpec(**BASE, device=f"cuda:{last}")
    pool, _ = make_pool(spec)
    dmgr = KVManager("decode", pool, cfg, spec.fingerprint())
    try:
        assert len(set(DST)) == len(DST) == len(SRC)
        prefill.call("create_sender", 1)
        r = dmgr.create_receiver(1, prefill.bootstrap_addr)
        r.init(DST)
        _send_three_chunks(prefill, 1)
        assert wait_for(r, KVPoll.Success, 30) == KVPoll.Success, r.failure_reason
        assert page_checksum(pool, DST) == prefill.call("checksum", SRC)
    finally:
        dmgr.close()
        assert prefill.close() == []


@pytest.mark.parametrize(("backend", "ucx_tls", "rma", "path"), [
    # UCX free to pick: it maps decode's pool here (cuda_ipc), one copy kernel per chunk
    ("ucx", None, "1", "ucx/mapped"),
    ("ucx", None, "1:puts", "ucx/puts"),  # the same with PDSERVE_UCX_MAPPED=0: a put per run
    ("ucx", None, "0", "ucx/staged"),  # staged tagged messages
    ("ucx", "tcp,cuda_copy", "1", "ucx/puts"),  # through host memory, as across hosts
    ("ucx", "tcp,cuda_copy", "0", "ucx/staged"),
    ("nixl", None, "1", None),
])
def test_network_backends_between_two_processes_on_one_gpu(
        backend: str, ucx_tls: str | None, rma: str, path: str | None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both workers are child processes on GPU 0 (UCX reads UCX_TLS when it starts, so the
    mode is set before they spawn). ucx one-sided (decode maps its pool: the sender copies
    with one kernel where UCX maps that pool here, else puts a run at a time) or staged, three
    pages per message (the scattered chunk crosses both staging buffers several times); the
    pages arrive bit-exact and nothing stays registered."""
    if not importable(backend):
        pytest.skip(f"{backend} is not installed")
    rma, _, puts = rma.partition(":")
    monkeypatch.setenv("PDSERVE_UCX_RMA", rma)
    monkeypatch.setenv("PDSERVE_UCX_MAPPED", "0" if puts else "1")
    if ucx_tls is None:
        monkeypatch.delenv("UCX_TLS", raising=False)
    else:
        monkeypatch.setenv("UCX_TLS", ucx_tls)
    spec = PoolSpec(**BASE, device="cuda:0")
    cfg = TransferConfig(backend=backend, stage_bytes=3 * spec.page_bytes)
    prefill = PeerProcess("prefill", PoolSpec(**BASE, seed=6, device="cuda:0"), cfg)
    decode = PeerProcess("decode", spec, cfg)
    try:
        for room in (1, 2):  # the first room to the new peer, then a later one
            prefill.call("create_sender", room)
            decode.call("create_receiver", room, prefill.bootstrap_addr)
            decode.call("init", room, DST)
            _send_three_chunks(prefill, room)
            st, reason = decode.call("wait", room, int(KVPoll.Success), 60)
            assert st == KVPoll.Success, reason
            assert decode.call("checksum", DST) == prefill.call("checksum", SRC)
            assert decode.call("aux", room) == (3, -0.1, 0)
            if path is not None:
                assert list(prefill.call("paths").values()) == [path]
    finally:
        assert decode.close() == []
        assert prefill.close() == []

"""cuda_ipc between two processes on GPU (runs on the GPU machine; skipped without CUDA)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kvtransfer import KVManager, KVPoll, TransferConfig
from pdserve.kvtransfer.peer import PeerProcess, PoolSpec, make_pool, page_checksum

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_pages_arrive_bit_exact() -> None:
    cfg = TransferConfig(backend="cuda_ipc")
    last = torch.cuda.device_count() - 1
    base = {"num_pages": 64, "num_layers": 4, "page_size": 16, "num_kv_heads": 2,
            "head_dim": 64}
    prefill = PeerProcess("prefill", PoolSpec(**base, seed=5, device="cuda:0"), cfg)
    spec = PoolSpec(**base, device=f"cuda:{last}")
    pool, _ = make_pool(spec)
    dmgr = KVManager("decode", pool, cfg, spec.fingerprint())
    try:
        src, dst = [3, 4, 5, 9, 20], [40, 41, 42, 7, 8]
        prefill.call("create_sender", 1)
        r = dmgr.create_receiver(1, prefill.bootstrap_addr)
        r.init(dst)
        assert prefill.call("wait", 1, int(KVPoll.WaitingForInput), 30)[0] == 2
        prefill.call("send", 1, src[:2], 0, False, None)
        prefill.call("send", 1, src[2:], 2, True, (3, -0.1, 0))
        t0 = time.monotonic()
        while r.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() - t0 < 30:
            time.sleep(0.005)
        assert r.poll() == KVPoll.Success, r.failure_reason
        assert page_checksum(pool, dst) == prefill.call("checksum", src)
    finally:
        dmgr.close()
        assert prefill.close() == []

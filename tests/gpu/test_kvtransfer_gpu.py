"""cuda_ipc between two processes on GPU (runs on the GPU machine; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.kv_peer import PeerProcess, PoolSpec, make_pool, page_checksum, wait_for
from pdserve.kvtransfer import KVManager, KVPoll, TransferConfig

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ipc_copy", ["auto", "triton", "staged"])
def test_cuda_ipc_pages_arrive_bit_exact(ipc_copy: str) -> None:
    """A few runs (peer copies, or the kernel with "triton"), then a chunk of scattered pages
    (the Triton page-to-page kernel, or gather / peer copy / scatter with "staged")."""
    cfg = TransferConfig(backend="cuda_ipc", ipc_copy=ipc_copy)
    last = torch.cuda.device_count() - 1
    base = {"num_pages": 64, "num_layers": 4, "page_size": 16, "num_kv_heads": 2,
            "head_dim": 64}
    prefill = PeerProcess("prefill", PoolSpec(**base, seed=5, device="cuda:0"), cfg)
    spec = PoolSpec(**base, device=f"cuda:{last}")
    pool, _ = make_pool(spec)
    dmgr = KVManager("decode", pool, cfg, spec.fingerprint())
    try:
        # Then 20 pages of which no two are consecutive on either side.
        far = [*range(62, 43, -2), *range(38, 19, -2)]
        src, dst = [3, 4, 5, 9, 20, *range(21, 61, 2)], [40, 41, 42, 7, 8, *far]
        assert len(set(dst)) == len(dst) == len(src)
        prefill.call("create_sender", 1)
        r = dmgr.create_receiver(1, prefill.bootstrap_addr)
        r.init(dst)
        assert prefill.call("wait", 1, int(KVPoll.WaitingForInput), 30)[0] == 2
        prefill.call("send", 1, src[:2], 0, False, None)
        prefill.call("send", 1, src[2:5], 2, False, None)
        prefill.call("send", 1, src[5:], 5, True, (3, -0.1, 0))
        assert wait_for(r, KVPoll.Success, 30) == KVPoll.Success, r.failure_reason
        assert page_checksum(pool, dst) == prefill.call("checksum", src)
    finally:
        dmgr.close()
        assert prefill.close() == []

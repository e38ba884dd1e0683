"""KV between tensor-parallel workers of different sizes over cuda_ipc (two processes; every
rank's pool on GPU 0, mapped by CUDA IPC as a worker's rank 0 maps its ranks'): each decode
rank gets its heads of every page, bit-exact, from a split, a gathered and a whole-page
layout; nothing stays registered."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.kv_peer import PeerProcess, PoolSpec, kv_checksum, make_manager, wait_for
from pdserve.kvtransfer import KVPoll, TransferConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BASE = {"num_pages": 64, "num_layers": 4, "page_size": 16, "num_kv_heads": 8, "head_dim": 64}
SRC = [3, 4, 5, 9, 20, *range(21, 41, 2)]
DST = [40, 41, 42, 7, 8, *range(62, 43, -2)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2), (4, 2)])
def test_cuda_ipc_lanes_bit_exact(prefill_tp: int, decode_tp: int) -> None:
    cfg = TransferConfig(backend="cuda_ipc")
    prefill = PeerProcess("prefill", PoolSpec(**BASE, seed=7, device="cuda:0", tp=prefill_tp),
                          cfg)
    mgr, pools, _ = make_manager("decode", PoolSpec(**BASE, device="cuda:0", tp=decode_tp), cfg)
    try:
        prefill.call("create_sender", 1)
        r = mgr.create_receiver(1, prefill.bootstrap_addr)
        r.init(DST)
        assert prefill.call("wait", 1, int(KVPoll.WaitingForInput), 60)[0] == 2
        prefill.call("send", 1, SRC[:5], 0, False, None)
        prefill.call("send", 1, SRC[5:], 5, True, (3, -0.1, 0))
        assert wait_for(r, KVPoll.Success, 30) == KVPoll.Success, r.failure_reason
        assert kv_checksum(pools, DST) == prefill.call("checksum", SRC)
    finally:
        mgr.close()
        assert mgr.registered_regions() == []
        assert prefill.close() == []

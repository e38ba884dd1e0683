"""pdserve.kvtransfer: moves a request's KV pages from a prefill worker to a decode worker.

Worker-facing API (one KVManager per worker; rooms are 63-bit bootstrap ids)::

    mgr = KVManager(role="prefill" | "decode", pool_buffer, config: TransferConfig,
                    fingerprint: Fingerprint | None = None, pools: PoolSet | None = None)
    KVManager.for_worker(role, pool, model, num_kv_heads, rank_pools, share, config)
    mgr.bootstrap_addr                      # prefill: "host:port" of its ZMQ bootstrap endpoint
    s = mgr.create_sender(room)             # prefill: Bootstrapping until decode registers
    s.num_dst_pages                         # pages decode registered
    s.send(src_pages, start_page, last, aux=None)   # non-blocking; last chunk carries AuxData
    r = mgr.create_receiver(room, bootstrap_addr)   # decode
    r.init(dst_pages)                       # registers destination pages and an aux slot
    s.poll() / r.poll() -> KVPoll           # cheap, thread-safe; monotonic, Failed overrides
    s.abort(reason) / r.abort(reason)       # the peer is told; both release
    s.failure_reason / r.failure_reason ; r.aux -> AuxData (after Success)
    mgr.close()                             # fails live rooms, stops threads, deregisters

With tensor parallelism (`pools`, rank_pools.py) a worker's KV spans one pool per rank, each
holding some KV heads; its rank 0 maps them all and runs the transfers: each decode rank gets
its heads of every page from the prefill ranks that hold them (lanes.py; layouts in the
fingerprint, mapped at the handshake, refused naming both when a backend cannot map them).

`pool_buffer` is the page-major pool tensor `[num_pages, num_layers, 2, page_size, kv_heads,
head_dim]` (page 0 reserved), or on decode a ShmPoolBuffer from `alloc_shm_pool(...)` so that a
prefill worker on the same host writes pages one-sided (backend "shm"). Backends: shm (same
host, host memory), cuda_ipc (same host, GPU), nixl (NIXL, any host: one-sided writes into the
registered pool), ucx (ucxx, any host), tcp (pyzmq, any host). With "auto" each pair picks by
where the peer is (hosts.py); `mgr.offered_backends` lists what a worker offers.

Ownership: source pages stay the prefill scheduler's and must not be reused before the sender
is Success/Failed; destination pages stay the decode scheduler's and are not written after the
receiver reports Failed. Neither side frees pages: the schedulers do, after poll() ends.
"""

from pdserve.kvtransfer.aux import AuxData
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.fingerprint import Fingerprint, FingerprintMismatch
from pdserve.kvtransfer.manager import KVManager
from pdserve.kvtransfer.poll import KVPoll
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.shm_pool import ShmPoolBuffer, alloc_shm_pool

__all__ = [
    "AuxData", "Fingerprint", "FingerprintMismatch", "KVManager", "KVPoll", "KVReceiver",
    "KVSender", "ShmPoolBuffer", "TransferConfig", "alloc_shm_pool",
]

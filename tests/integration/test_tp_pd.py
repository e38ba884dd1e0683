"""P/D between tensor-parallel workers of different sizes, served end to end (real processes,
gloo between each worker's ranks, shm KV transfer rank pool to rank pool): prefill TP 1 ->
decode TP 2 and TP 2 -> TP 1 on a tiny Llama, TP 3 -> TP 1 on SmolLM2 (3 KV heads, one per
rank) answer like HF greedy, i.e. like TP=1 P/D. Killing one rank of a decode worker mid-stream
ends its streams with an error within the fault deadlines, and the prefill worker is left with
no page in use. The SmolLM2 pair starts through `pdserve up --prefill-tp 3`."""
# ruff: noqa: F811  (pytest fixtures imported from test_faults_procs)

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

from fixtures.cluster import start_cluster
from fixtures.hf_ref import hf_greedy, hf_model
from test_faults_decode import LONG, Stream
from test_faults_procs import post, procs  # noqa: F401 (fixture)

PROMPTS = ["The capital of France is", "Paged attention stores the keys"]

# A prompt of several pages and KV chunks (--chunked-prefill-size 16), and a short one.
CHUNKED = ("Prefill runs the prompt once; decode then produces one token at a time for many "
           "requests. A router sends each request to one prefill worker and one decode worker.")


def hf_text(path: str, prompt: str, max_tokens: int) -> str:
    _, tok = hf_model(path)
    return tok.decode(hf_greedy(path, tok.encode(prompt), max_tokens),
                      skip_special_tokens=True)


def _check_pair(procs, model: str, prefill_tp: int, decode_tp: int,
                prompts: list[str]) -> tuple:
    prefill = procs.start_worker("prefill", f"--tp={prefill_tp}", "--chunked-prefill-size=16")
    decode = procs.start_worker("decode", f"--tp={decode_tp}")
    assert (prefill.fields["tp"], decode.fields["tp"]) == (str(prefill_tp), str(decode_tp))
    procs.wait_workers(lambda ws: sum(w["state"] == "healthy" for w in ws) == 2, 60)
    url = f"{procs.url}/v1/completions"
    for prompt in prompts:
        status, body = post(url, {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                  "ignore_eos": True})
        assert status == 200, body
        choice = body["pdserve"]["choices"][0]
        assert choice["disaggregation"]["disaggregated"], body
        assert body["choices"][0]["text"] == hf_text(model, prompt, 8), (prompt, prefill_tp,
                                                                         decode_tp)
    return prefill, decode


def _stop(procs, *workers) -> None:
    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(60) == 0, w.tail()
    addresses = {w.fields["grpc"] for w in workers}
    procs.wait_workers(lambda ws: not any(w["address"] in addresses for w in ws), 30)


def test_tiny_prefill_1_to_decode_2_then_2_to_1_and_a_decode_rank_dies(procs, tiny_model_dir):
    procs.start_router()
    prompts = [*PROMPTS, CHUNKED]
    prefill, decode = _check_pair(procs, tiny_model_dir, 1, 2, prompts)
    # One rank of the decode worker dies mid-stream: its streams end with an error, the
    # worker exits, and prefill holds no page for it once its KV peer is seen gone.
    rank1 = int(decode.fields["pids"].split(",")[1])
    url = f"{procs.url}/v1/completions"
    with cf.ThreadPoolExecutor(3) as pool:
        streams = [Stream(url, {**LONG, "prompt": f"{LONG['prompt']} {i}"}) for i in range(3)]
        futures = [pool.submit(s.run) for s in streams]
        for s in streams:
            assert s.first.wait(120)
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        cf.wait(futures, timeout=60)
        elapsed = time.monotonic() - t0
    assert all(f.done() for f in futures)
    assert elapsed < 30, elapsed  # health check 0.5 s + liveness check + heartbeat window
    assert all(s.error and s.finish is None for s in streams), [s.__dict__ for s in streams]
    assert decode.wait(30) == 3
    assert f"tensor-parallel rank 1 of 2 (pid {rank1}) exited with code -9; the decode worker " \
        "goes down" in "".join(decode.log)
    workers = procs.wait_workers(
        lambda ws: [w["role"] for w in ws if w["state"] == "healthy"] == ["prefill"]
        and all(w["kv_pages_in_use"] == 0 and w["num_inflight"] == 0 for w in ws
                if w["role"] == "prefill"), 60)
    assert workers
    _stop(procs, prefill)
    prefill, decode = _check_pair(procs, tiny_model_dir, 2, 1, prompts)
    procs.wait_idle(60)


def test_smollm2_prefill_3_to_decode_1_through_pdserve_up(smollm2_path):
    """`pdserve up --prefill-tp 3`: SmolLM2's 3 KV heads one per prefill rank, gathered into
    the decode worker's one pool."""
    cluster = start_cluster(smollm2_path, up_args=("--prefill-tp", "3"),
                            worker_args=("--chunked-prefill-size=16",))
    try:
        url = f"{cluster.url}/v1/completions"
        for prompt in ("The capital of France is", CHUNKED):
            status, body = post(url, {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                      "ignore_eos": True})
            assert status == 200, body
            assert body["pdserve"]["choices"][0]["disaggregation"]["disaggregated"], body
            assert body["choices"][0]["text"] == hf_text(smollm2_path, prompt, 8), prompt
        workers = cluster.wait_idle(60)
        assert all(w["kv_pages_in_use"] == 0 for w in workers), workers
    finally:
        assert cluster.stop() == 0, "".join(cluster.log[-30:])

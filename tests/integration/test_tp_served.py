"""Tensor-parallel workers served end to end (real processes, gloo between the ranks): a
`mixed --tp 2` worker answers like HF greedy (= TP=1), and killing one of its ranks mid-stream
takes the worker down with a log line naming the rank, its stream ending in an error."""
# ruff: noqa: F811  (pytest fixtures imported from test_faults_procs)

from __future__ import annotations

import concurrent.futures as cf
import os
import signal

from fixtures.hf_ref import hf_greedy, hf_model
from test_faults_decode import LONG, Stream
from test_faults_procs import post, procs  # noqa: F401 (fixture)

PROMPTS = ["The capital of France is", "Paged attention stores the keys"]


def hf_text(path: str, prompt: str, max_tokens: int) -> str:
    _, tok = hf_model(path)
    return tok.decode(hf_greedy(path, tok.encode(prompt), max_tokens),
                      skip_special_tokens=True)


def test_mixed_tp2_serves_hf_greedy_and_dies_with_a_rank(procs, tiny_model_dir):
    procs.start_router()
    worker = procs.start_worker("mixed", "--tp=2")
    assert worker.fields["tp"] == "2"
    rank0, rank1 = (int(p) for p in worker.fields["pids"].split(","))
    procs.wait_healthy(1)
    url = f"{procs.url}/v1/completions"
    for prompt in PROMPTS:
        status, body = post(url, {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                  "ignore_eos": True})
        assert status == 200, body
        assert body["choices"][0]["text"] == hf_text(tiny_model_dir, prompt, 10)
    with cf.ThreadPoolExecutor(2) as pool:
        stream = Stream(url, LONG)
        future = pool.submit(stream.run)
        assert stream.first.wait(120)
        os.kill(rank1, signal.SIGKILL)
        assert worker.wait(30) == 3  # EXIT_RANK_LOST
        future.result(60)
    assert stream.error and stream.finish is None, stream.__dict__
    assert f"tensor-parallel rank 1 of 2 (pid {rank1}) exited with code -9" in worker.tail()
    procs.wait_workers(lambda ws: all(w["state"] != "healthy" for w in ws), 30)
    assert rank0 == worker.popen.pid

"""A random-weight model shape served end to end, and a worker warm before it registers.

The cluster serves `--model-shape tiny` (random weights, the embedded SmolLM2 tokenizer) with
prefill and decode apart, one request at a time per worker and one thread each, and streams a
request's tokens three at a time (`--stream-interval 3`), on top of whatever coalescing the load
adds. The offline engine with the same seeded weights, one request at a time on one thread,
computes the same numbers: 32 concurrent streams must give exactly its text, finish reasons,
usage and logprobs, however their tokens were batched into messages.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading

import grpc
import httpx
import pytest
import torch
from fixtures.cluster import start_cluster

from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2 as pb
from pdserve.proto import pdserve_pb2_grpc as pb_grpc

WORKER_ARGS = ("--max-running=1", "--threads=1", "--stream-interval=3")
WORDS = ("alpha beta gamma delta river stone cloud paper light north silver garden window "
         "music orange valley summer number yellow forest").split()


@pytest.fixture(scope="module")
def cluster():
    # One request at a time per worker: the router's queue bound must hold all 32 streams.
    c = start_cluster(None, prefill=1, decode=1, worker_args=WORKER_ARGS,
                      router_args=("--max-queued-requests=64",),
                      up_args=("--model-shape", "tiny"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def offline() -> LLM:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        yield LLM(model_shape="tiny", device="cpu", max_running=1)
    finally:
        torch.set_num_threads(threads)


def _requests(offline: LLM) -> list[dict]:
    """32 completions: greedy and seeded, logprobs or not, stop strings and stop tokens taken
    from the offline answers so that they really end the streams part-way."""
    rng = random.Random(7)
    out = []
    for i in range(32):
        # Distinct first words: no prompt shares a cached page with another.
        prompt = " ".join([WORDS[i % len(WORDS)].upper() + str(i)]
                          + [rng.choice(WORDS) for _ in range(rng.randint(3, 30))])
        body: dict = {"prompt": prompt, "max_tokens": rng.randint(4, 24), "temperature": 0.0,
                      "ignore_eos": True}
        if i % 4 == 1:
            body.update(temperature=0.8, top_p=0.9, seed=i)
        if i % 3 == 0:
            body["logprobs"] = 2
        if i % 5 == 2:  # a stop string from the middle of the unconstrained answer
            text = _offline(offline, dict(body, max_tokens=24))["text"]
            if len(text) > 8:
                body.update(max_tokens=24, stop=[text[len(text) // 2:len(text) // 2 + 3]])
        if i % 7 == 3:  # a stop token from the answer
            ids = _offline(offline, dict(body, max_tokens=24))["token_ids"]
            body.update(max_tokens=24, stop_token_ids=[ids[len(ids) // 2]])
        out.append(body)
    return out


def _offline(llm: LLM, body: dict) -> dict:
    sp = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                        top_p=body.get("top_p", 1.0), seed=body.get("seed"),
                        ignore_eos=True, stop=tuple(body.get("stop", ())),
                        stop_token_ids=tuple(body.get("stop_token_ids", ())),
                        logprobs=body.get("logprobs"))
    o = llm.generate([body["prompt"]], sp)[0]
    return {"text": o.text, "finish_reason": o.finish_reason, "token_ids": o.token_ids,
            "prompt_tokens": o.prompt_tokens, "logprobs": o.logprobs,
            "top_logprobs": o.top_logprobs}


async def _stream(http: httpx.AsyncClient, body: dict) -> dict:
    text, reason, usage, lps, chunks = "", None, None, [], 0
    payload = dict(body, stream=True, stream_options={"include_usage": True})
    async with http.stream("POST", "/v1/completions", json=payload) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj["choices"]:
                chunks += 1
                text += c["text"]
                reason = c["finish_reason"] or reason
                if c["logprobs"]:
                    lps.append(c["logprobs"])
    return {"text": text, "finish_reason": reason, "usage": usage, "logprobs": lps,
            "chunks": chunks}


def test_concurrent_streams_equal_the_offline_engine(cluster, offline) -> None:
    bodies = _requests(offline)
    want = [_offline(offline, b) for b in bodies]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            return await asyncio.gather(*(_stream(http, b) for b in bodies))

    got = asyncio.run(run())
    tok = offline.tokenizer
    for body, w, g in zip(bodies, want, got):
        what = json.dumps(body)
        assert g["text"] == w["text"], what
        assert g["finish_reason"] == w["finish_reason"], what
        assert g["usage"]["completion_tokens"] == len(w["token_ids"]), what
        assert g["usage"]["prompt_tokens"] == w["prompt_tokens"], what
        if body.get("logprobs") is None:
            assert not g["logprobs"]
            continue
        tokens = [t for part in g["logprobs"] for t in part["tokens"]]
        values = [v for part in g["logprobs"] for v in part["token_logprobs"]]
        tops = [t for part in g["logprobs"] for t in part["top_logprobs"]]
        offsets = [o for part in g["logprobs"] for o in part["text_offset"]]
        n = len(w["token_ids"])
        assert tokens == [tok.decode([t]) for t in w["token_ids"]], what
        assert values == pytest.approx(w["logprobs"][:n], abs=1e-5), what
        assert len(tops) == n, what
        for top, (ids, lp) in zip(tops, w["top_logprobs"]):
            ref = {tok.decode([t]): v for t, v in zip(ids, lp)}
            assert top.keys() == ref.keys(), what
            assert [top[k] for k in ref] == pytest.approx(list(ref.values()), abs=1e-5)
        assert offsets == sorted(offsets) and offsets[:1] == [0]
    # Tokens really travelled batched: fewer chunks than tokens.
    assert sum(g["chunks"] for g in got) < sum(g["usage"]["completion_tokens"] for g in got)
    workers = cluster.wait_idle()
    assert all(w["kv_pages_in_use"] == 0 for w in workers)


def test_model_shape_is_served_under_its_name(cluster) -> None:
    models = cluster.get("/v1/models")["data"]
    assert [m["id"] for m in models] == ["tiny"] and models[0]["max_model_len"] == 4096
    with httpx.Client(base_url=cluster.url, timeout=120) as http:
        resp = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"


class _Router(pb_grpc.RouterServicer):
    """Records registrations; answers heartbeats."""

    def __init__(self) -> None:
        self.registered: list[pb.WorkerInfo] = []
        self.event = threading.Event()

    async def RegisterWorker(self, request, context):
        self.registered.append(request.worker)
        self.event.set()
        return pb.RegisterWorkerResponse(worker_id="w1", heartbeat_interval_s=1.0, lease_s=10.0)

    async def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(known=True)


def test_worker_registers_only_after_its_warm_up() -> None:
    router = _Router()
    ready = threading.Event()
    holder: dict = {}

    async def serve() -> None:
        server = grpc.aio.server()
        pb_grpc.add_RouterServicer_to_server(router, server)
        holder["port"] = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.set()
        while not holder.get("stop"):
            await asyncio.sleep(0.1)
        await server.stop(None)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    ready.wait(30)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "mixed", "--model-shape", "tiny", "--device", "cpu",
         "--router", f"127.0.0.1:{holder['port']}", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert router.event.wait(240), proc.stdout.read() if proc.poll() is not None else ""
        info = router.registered[0]
        paths = dict(info.warmup_s)
        assert set(paths) == {"weight_packing", "cpu_decode_kernel", "prefill",
                              "prefill_cached_prefix", "decode", "decode_overlap"}
        assert all(s > 0 for s in paths.values())
        assert info.load.kv_pages_in_use == 0 and info.load.kv_pages_cached == 0
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        holder["stop"] = True
        thread.join(10)

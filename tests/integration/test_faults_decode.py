"""Decode-side faults with real processes: a decode worker SIGKILLed mid-decode and
mid-transfer, a hung (stopped) decode worker, a client that disconnects mid-stream."""
# ruff: noqa: F811  (pytest fixtures imported from test_faults_procs)

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import threading
import time

import httpx
from test_faults_procs import post, procs  # noqa: F401 (fixture)

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
SHORT = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
         "ignore_eos": True}


class Stream:
    """One streaming completion read on a thread: its text events, finish or error."""

    def __init__(self, url: str, body: dict) -> None:
        self.url, self.body = url, {**body, "stream": True}
        self.chunks = 0
        self.finish: str | None = None
        self.error: str | None = None
        self.done = False
        self.first = threading.Event()

    def run(self) -> Stream:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=180) as r:
                if r.status_code != 200:
                    self.error = f"HTTP {r.status_code}: {r.read()!r}"
                    return self
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        self.error = obj["error"]["message"]
                        continue
                    for c in obj.get("choices", []):
                        self.chunks += 1
                        self.first.set()
                        self.finish = c.get("finish_reason") or self.finish
                self.done = True
        except httpx.HTTPError as e:
            self.error = f"transport: {e!r}"
        finally:
            self.first.set()
        return self


def _streams(pool: cf.ThreadPoolExecutor, url: str, n: int, body: dict):
    streams = [Stream(url, {**body, "prompt": f"{body['prompt']} {i}"}) for i in range(n)]
    return streams, [pool.submit(s.run) for s in streams]


def test_decode_killed_mid_decode_then_mid_transfer(procs):
    procs.start_router()
    _, one, two = procs.start_workers("prefill", "decode", "decode")
    procs.wait_healthy(3)
    url = f"{procs.url}/v1/completions"
    # Mid-decode: every stream has output when the victim dies. Streams on the victim end with
    # an error event (tokens were already sent: no retry); the others finish.
    with cf.ThreadPoolExecutor(6) as pool:
        streams, futures = _streams(pool, url, 6, LONG)
        for s in streams:
            assert s.first.wait(120)
        # On a loaded machine one worker's streams can finish before the last stream starts:
        # the victim is the decode worker that runs the most streams now.
        # (The load in /workers comes with heartbeats: wait for one that shows it.)
        ws = procs.wait_workers(lambda ws: any(w["role"] == "decode" and w["num_running"] > 0
                                               for w in ws), 10)
        running = {w["address"]: w["num_running"] for w in ws}
        victim, survivor = sorted((one, two), key=lambda p: -running.get(p.fields["grpc"], 0))
        victim.signal(signal.SIGSTOP)
        victim.signal(signal.SIGKILL)
        victim.signal(signal.SIGCONT)
        cf.wait(futures, timeout=180)
    assert all(f.done() for f in futures)
    failed = [s for s in streams if s.error]
    assert failed, "no stream was on the killed worker"
    for s in streams:
        assert s.done or s.error, "a stream neither finished nor failed"
        if not s.error:
            assert s.finish == "length", s.__dict__
    procs.wait_workers(lambda ws: all(w["address"] != victim.fields["grpc"]
                                      or w["state"] != "healthy" for w in ws), 30)
    # Mid-transfer: a fresh decode worker is frozen while requests wait on it, then killed.
    # None had sent a token, so every one is retried on a fresh pair and succeeds.
    frozen = procs.start_worker("decode")
    procs.wait_workers(lambda ws: sum(w["state"] == "healthy" and w["role"] == "decode"
                                      for w in ws) == 2, 60)
    frozen.signal(signal.SIGSTOP)
    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(post, url, {**SHORT, "prompt": f"{SHORT['prompt']} {i}"})
                   for i in range(6)]
        time.sleep(1.0)
        frozen.signal(signal.SIGKILL)
        frozen.signal(signal.SIGCONT)
        results = [f.result() for f in futures]
    assert [s for s, _ in results] == [200] * 6, results
    for _, body in results:
        assert body["pdserve"]["choices"][0]["decode_worker"] == survivor.fields["grpc"]
    dead = {victim.fields["grpc"], frozen.fields["grpc"]}
    procs.wait_workers(lambda ws: all(w["kv_pages_in_use"] == 0 and w["num_running"] == 0
                                      for w in ws if w["address"] not in dead), 60)
    status, body = post(url, SHORT)
    assert status == 200, body


def test_hung_decode_fails_streams_in_seconds_and_recovers(procs):
    """A decode worker that stops (no RST: gRPC sees nothing) fails its streams within a
    health-check round, not at the request deadline; continued, it frees every page."""
    procs.start_router("--request-timeout=300")
    _, decode = procs.start_workers("prefill", "decode")
    procs.wait_healthy(2)
    url = f"{procs.url}/v1/completions"
    with cf.ThreadPoolExecutor(4) as pool:
        streams, futures = _streams(pool, url, 4, LONG)
        for s in streams:
            assert s.first.wait(120)
        decode.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        cf.wait(futures, timeout=120)
        elapsed = time.monotonic() - t0
        decode.signal(signal.SIGCONT)
    assert all(f.done() for f in futures)
    assert elapsed < 30, elapsed  # health check 0.5 s + timeout 2 s + liveness check 1 s
    assert all(s.error or s.finish == "length" for s in streams)
    assert any(s.error for s in streams)
    procs.wait_healthy(2, 60)  # back in rotation once it answers health checks again
    procs.wait_idle(60)
    status, body = post(url, SHORT)
    assert status == 200, body
    # Stopped before its transfers: the prefill side fails the rooms (bootstrap deadline or
    # missed KV heartbeats), and the request gets a clear error in seconds.
    decode.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    status, body = post(url, SHORT)
    elapsed = time.monotonic() - t0
    decode.signal(signal.SIGCONT)
    assert status in (502, 503, 504) and body["error"]["message"], body
    assert elapsed < 30, elapsed
    procs.wait_healthy(2, 60)
    procs.wait_idle(60)
    status, body = post(url, SHORT)
    assert status == 200, body


def test_client_disconnect_mid_stream_frees_everything(procs):
    procs.start_router()
    procs.start_workers("prefill", "decode")
    procs.wait_healthy(2)
    url = f"{procs.url}/v1/completions"
    body = {**LONG, "max_tokens": 480, "stream": True}

    def read_two_and_leave(i: int) -> int:
        got = 0
        with httpx.stream("POST", url, json={**body, "prompt": f"story {i}"}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got == 2:
                        break  # closing the response drops the connection mid-stream
        return got

    with cf.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(read_two_and_leave, range(8))) == [2] * 8
    workers = procs.wait_idle(60)
    assert all(w["kv_pages_in_use"] == 0 for w in workers)
    finished = [ln for ln in procs.metrics().splitlines()
                if ln.startswith("pdserve_router_finished_total")]
    assert not any('reason="length"' in ln and float(ln.split()[-1]) >= 8 for ln in finished)
    status, out = post(url.replace("/v1/completions", "/v1/completions"), {
        "prompt": "hello", "max_tokens": 4})
    assert status == 200, out

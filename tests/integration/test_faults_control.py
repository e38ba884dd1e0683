"""Control-plane faults with real processes: the router restarted under load after a long
outage (workers re-register at once, in-flight requests end cleanly), a worker drained with
SIGTERM."""
# ruff: noqa: F811  (pytest fixtures imported from test_faults_procs)

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

from test_faults_decode import LONG, SHORT, _streams
from test_faults_procs import post, procs  # noqa: F401 (fixture)

# gRPC's own reconnect backoff would have grown to ~10-16 s gaps by then (1 s x 1.6^n): the
# workers' bounded reconnect must find the new router within REREGISTER_S of its ready line
# (the figure on a quiet machine, after a 60 s outage, is in docs/reliability.md).
OUTAGE_S = 30.0
REREGISTER_S = 5.0


def test_router_restart_workers_reregister_and_free(procs):
    router = procs.start_router()
    procs.start_workers("prefill", "decode")
    procs.wait_healthy(2)
    grpc_port = int(procs.grpc_addr.rpartition(":")[2])
    with cf.ThreadPoolExecutor(4) as pool:
        streams, futures = _streams(pool, f"{procs.url}/v1/completions", 4, LONG)
        for s in streams:
            assert s.first.wait(120)
        router.signal(signal.SIGKILL)
        killed = time.monotonic()
        cf.wait(futures, timeout=60)
    assert all(f.done() for f in futures)
    assert all(s.error or s.finish == "length" for s in streams)  # ended, none hangs
    # A new router on the same gRPC address after a long outage: the workers find it and
    # register again at once.
    time.sleep(max(0.0, killed + OUTAGE_S - 3.0 - time.monotonic()))  # it starts in ~3 s
    procs.start_router(grpc_port=grpc_port)
    ready = time.monotonic()
    while sum(w["state"] == "healthy" for w in procs.workers()) < 2:
        assert time.monotonic() - ready < REREGISTER_S, (procs.workers(), procs.logs())
        time.sleep(0.05)
    print(f"reregistered-result outage_s={ready - killed:.1f} "
          f"reregistered_s={time.monotonic() - ready:.2f}")
    procs.wait_idle(60)  # the dropped streams were aborted on the workers: nothing leaked
    status, body = post(f"{procs.url}/v1/completions", SHORT)
    assert status == 200, body


def test_sigterm_drains_worker(procs):
    procs.start_router()
    _, draining, _ = procs.start_workers("prefill", "decode", "decode")
    procs.wait_healthy(3)
    url = f"{procs.url}/v1/completions"
    with cf.ThreadPoolExecutor(6) as pool:
        streams, futures = _streams(pool, url, 6, LONG)
        for s in streams:
            assert s.first.wait(120)
        draining.signal(signal.SIGTERM)
        # Admissions stop at once: new requests go to the other decode worker.
        procs.wait_workers(lambda ws: all(w["address"] != draining.fields["grpc"]
                                          or w["state"] != "healthy" for w in ws), 30)
        status, body = post(url, SHORT)
        assert status == 200, body
        cf.wait(futures, timeout=180)
    # In-flight requests finished normally; the worker deregistered and exited 0.
    assert all(s.finish == "length" and not s.error for s in streams), \
        [s.__dict__ for s in streams]
    assert draining.wait(60) == 0, draining.tail()
    procs.wait_workers(lambda ws: all(w["address"] != draining.fields["grpc"] for w in ws), 30)
    procs.wait_idle(60)


def test_conditional_disaggregation_on_real_workers(procs):
    """--disagg-threshold: short prompts are prefilled on the decode worker (empty bootstrap
    address), long ones go through prefill; each response and the metrics say which and why.
    With --local-prefill-fallback, losing every prefill worker keeps the service up."""
    procs.start_router("--disagg-threshold=32", "--local-prefill-fallback")
    prefill, decode = procs.start_workers("prefill", "decode")
    procs.wait_healthy(2)
    url = f"{procs.url}/v1/completions"
    status, short = post(url, {"prompt": "hello there", "max_tokens": 4, "temperature": 0})
    assert status == 200, short
    info = short["pdserve"]["choices"][0]
    assert info["prefill_worker"] == "" and info["decode_worker"] == decode.fields["grpc"]
    assert info["disaggregation"]["disaggregated"] is False
    assert info["disaggregation"]["reason"] == "short_prompt"
    status, long = post(url, {"prompt": "word " * 60, "max_tokens": 4, "temperature": 0})
    assert status == 200, long
    info = long["pdserve"]["choices"][0]
    assert info["prefill_worker"] == prefill.fields["grpc"]
    assert info["disaggregation"] == {"disaggregated": True, "reason": "long_prompt",
                                      "prompt_len": long["usage"]["prompt_tokens"],
                                      "uncached_len": long["usage"]["prompt_tokens"],
                                      "threshold": 32}
    metrics = procs.metrics()
    assert 'pdserve_router_disagg_decisions_total{decision="local",reason="short_prompt"} 1.0' \
        in metrics
    assert 'pdserve_router_disagg_decisions_total{decision="remote",reason="long_prompt"} 1.0' \
        in metrics
    prefill.signal(signal.SIGKILL)
    procs.wait_workers(lambda ws: not any(w["role"] == "prefill" and w["state"] == "healthy"
                                          for w in ws), 30)
    status, body = post(url, {"prompt": "word " * 60, "max_tokens": 4})
    assert status == 200, body
    assert body["pdserve"]["choices"][0]["disaggregation"]["reason"] == "no_prefill_worker"
    procs.wait_workers(lambda ws: all(w["kv_pages_in_use"] == 0 for w in ws
                                      if w["role"] == "decode"), 60)

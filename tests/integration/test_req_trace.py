"""`PDSERVE_REQ_TRACE=1` on a real 1P1D cluster: every hop of a request is stamped, once per
process that passes it, and `pdserve reqtrace` orders them along the request's path."""

from __future__ import annotations

import json

import httpx
import pytest
from fixtures.cluster import start_cluster

from pdserve.engine.req_trace import STAGES, main, summarize

PD_ONLY = ("decode-accept", "decode-queued", "decode-added", "registered", "bootstrapped",
           "answered", "reached", "transferred")


@pytest.mark.parametrize("topology", ["pd", "mixed"])
def test_a_request_passes_every_stage_in_order(monkeypatch, tmp_path, topology: str) -> None:
    monkeypatch.setenv("PDSERVE_REQ_TRACE", "1")  # the cluster's processes inherit it
    pd = topology == "pd"
    c = start_cluster(None, prefill=int(pd), decode=int(pd), mixed=int(not pd),
                      up_args=("--model-shape", "tiny"))
    try:
        for i in range(3):
            with httpx.stream("POST", c.url + "/v1/completions", timeout=60, json={
                    "prompt": f"trace {i} " + "river stone cloud " * 20, "max_tokens": 4,
                    "stream": True, "ignore_eos": True}) as r:
                assert r.status_code == 200
                assert any(line.startswith("data: [DONE]") for line in r.iter_lines())
    finally:
        assert c.stop() == 0
    lines = [line for line in c.log if "reqtrace " in line]
    assert not any("warmup-" in line for line in lines)
    log = tmp_path / "log"
    log.write_text("".join(c.log))
    medians = summarize(log.read_text().splitlines())
    want = [s for s in STAGES if pd or s not in PD_ONLY]
    assert list(medians) == want, medians  # every stage of the path, and no other
    # Each stage comes after the one before (the first stamp of each): the first token is
    # stamped sampled before its message can leave the worker. Decode's page registration runs
    # beside the prefill (which starts before it on an idle worker: tests/unit/
    # test_prefill_early_start.py), and ends before the KV can reach decode.
    # In P/D the router streams the first token from the prefill answer, while decode gets the
    # KV and sends its own copy (skipped by the router).
    side = ("decode-accept", "decode-queued", "decode-added", "registered", "bootstrapped",
            "transferred", "sent", "received")
    chain = [s for s in want if not pd or s not in side]
    times = [medians[s] for s in chain]
    assert times == sorted(times), medians
    if pd:
        assert medians["decode-accept"] < medians["decode-queued"] < medians["decode-added"] \
            <= medians["registered"], medians
        assert medians["queued"] < medians["registered"] < medians["bootstrapped"] \
            < medians["transferred"] < medians["sent"] < medians["received"], medians
        assert medians["sampled"] < medians["transferred"], medians
    assert medians["arrival"] == 0.0


def test_summary_joins_worker_ids_and_skips_requests_without_arrival(tmp_path, capsys) -> None:
    lines = ["reqtrace arrival a 1.000", "reqtrace dispatch a 1.001",
             "noise reqtrace accept a@7 1.003", "reqtrace accept a@7 1.009",  # first one wins
             "reqtrace first a 1.010", "reqtrace accept b@2 5.0", "reqtrace bogus a 1.5",
             "reqtrace first"]
    assert summarize(lines) == {"arrival": 0.0, "dispatch": 1.0, "accept": 3.0, "first": 10.0}
    log = tmp_path / "log"
    log.write_text("\n".join(lines))
    assert main([str(log)]) == 0
    assert json.loads(capsys.readouterr().out) == summarize(lines)

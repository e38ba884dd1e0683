"""On a real tiny CPU cluster: `pdserve up --spatial` says why it takes the plain path, and
the SLO dispatcher's decisions carry its estimates (it learns the prefill rate from first
tokens); every page comes back."""

from __future__ import annotations

import json
import urllib.request

import pytest
from fixtures.cluster import start_cluster


def _complete(url: str, prompt: str) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


@pytest.mark.timeout(180)
def test_spatial_plain_path_and_slo_dispatch(tiny_model_dir):
    c = start_cluster(tiny_model_dir, prefill=1, decode=1,
                      router_args=("--slo-ttft-ms=60000", "--slo-itl-ms=60000"),
                      up_args=("--spatial", "--prefill-sm-share", "0.3"))
    try:
        log = "".join(c.log)
        assert "spatial: needs --device cuda (got cpu); prefill and decode share the GPU " \
            "time-sliced (the plain path)" in log, log[-3000:]
        assert next(x for x in c.log if x.startswith("pdserve ready")).rstrip().endswith(
            "spatial=off")
        decisions = []
        for i in range(3):
            out = _complete(c.url, f"request {i} " + "word " * 40)
            assert out["usage"]["completion_tokens"] == 4
            decisions.append(out["pdserve"]["choices"][0]["disaggregation"])
        # Nothing measured before the first: the length decision stands, with no estimate.
        assert decisions[0]["reason"] == "always" and decisions[0]["slo"]["remote_ms"] is None
        for d in decisions[1:]:  # the prefill rate is known now; far under a 60 s SLO
            assert d["disaggregated"] and d["reason"] == "always"
            assert 0 < d["slo"]["remote_ms"] < 60000 and d["slo"]["stall_ms"] > 0
        for w in c.wait_idle():
            assert w["kv_pages_in_use"] == 0 and w["num_running"] == 0
    finally:
        assert c.stop() == 0, "".join(c.log[-30:])

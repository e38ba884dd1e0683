"""A worker's KV pool bounds its context: on a real tiny 1P1D cluster with small pools, the
router reports that bound and refuses a longer prompt with OpenAI's error at once (a prompt
that could never be admitted used to wait for pages until the request timed out)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from fixtures.cluster import start_cluster


@pytest.mark.timeout(180)
def test_prompt_longer_than_the_pool_is_refused_at_once() -> None:
    c = start_cluster(None, prefill=1, decode=1, up_args=("--model-shape", "tiny"),
                      worker_args=("--num-pages=40", "--page-size=4"))
    try:
        assert {w["max_context_len"] for w in c.get("/workers")["workers"]} == {39 * 4}
        body = json.dumps({"prompt": [5] * 200, "max_tokens": 4}).encode()
        req = urllib.request.Request(c.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400
        error = json.loads(err.value.read())["error"]
        assert error["code"] == "context_length_exceeded" and "156 tokens" in error["message"]
        for w in c.wait_idle():
            assert w["kv_pages_in_use"] == 0 and w["num_running"] == 0
    finally:
        assert c.stop() == 0, "".join(c.log[-30:])

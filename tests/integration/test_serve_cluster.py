"""serve-bench's cluster: a `pdserve up` that fails before ready says why."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.serve_cluster import Cluster


def test_a_cluster_that_exits_before_ready_names_the_workers_error(tmp_path) -> None:
    args = argparse.Namespace(model_shape="tiny", device="cpu", num_pages=1, out=str(tmp_path))
    with pytest.raises(RuntimeError) as e:
        Cluster(args, "pd")
    msg = str(e.value)
    assert msg.startswith("pdserve up (pd) exited 1 before ready: ")
    assert "num_pages: need at least 2 (page 0 is reserved), got 1" in msg
    assert "num_pages: need at least 2" in (tmp_path / "cluster-pd.log").read_text()

"""serve-bench's workload choice: built-in sizes, or the user's `--workloads`."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.serve_compare import (
    GPU_WORKLOADS,
    QUICK_WORKLOADS,
    Workload,
    add_workload_args,
    main,
    parse_workloads,
    table,
    workloads_of,
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_args(p)
    return p.parse_args(list(argv))


def test_built_in_sizes_and_pages_for_the_largest() -> None:
    args = _args()
    assert workloads_of(args) == GPU_WORKLOADS and args.model_shape == "llama3-8b"
    assert args.num_pages == 256 * 48 * 5 // 4 + 64  # 256 clients x (512 + 256) / 16 pages
    args = _args("--quick")
    assert workloads_of(args) == QUICK_WORKLOADS and args.model_shape == "tiny"


def test_user_workloads_replace_the_built_in_ones() -> None:
    args = _args("--workloads", "b:16:256:64:64,long:1:4000:8:3", "--model-shape", "tiny")
    assert workloads_of(args) == (Workload("b", 16, 256, 64, 64),
                                  Workload("long", 1, 4000, 8, 3))
    # the larger need: 16 clients x 20 pages (320 tokens) over one client x 251 (4,008 tokens)
    assert args.num_pages == 16 * 20 * 5 // 4 + 64


@pytest.mark.parametrize("spec", ["", "b:16:256:64", "b:16:256:64:0", ":1:2:3:4", "b:x:1:1:1"])
def test_bad_workloads_are_named(spec: str) -> None:
    with pytest.raises(ValueError, match="--workloads"):
        parse_workloads(spec)


def _report(served: dict) -> dict:
    return {"offline": {"roofline_ms": 4.0, "workloads": {"a": {"ttft_ms": 40.0, "itl_ms": 4.5},
                                                           "b": {"output_tok_s": 1000.0}}},
            "workloads": [{"name": "a", "clients": 1}, {"name": "b", "clients": 64}],
            "served": served}


def test_table_columns_follow_the_topologies_run() -> None:
    mixed = {"a": {"ttft_p50_ms": 42.0, "itl_p50_ms": 4.4}, "b": {"output_tok_s": 960.0}}
    lines = table(_report({"mixed": mixed})).splitlines()
    assert lines[0].split() == ["workload", "metric", "offline", "mixed", "ratio", "1P1D",
                                "ratio", "unit", "target"]
    b = next(x for x in lines if x.startswith("(b)"))
    assert "0.960" in b and " - " in b  # 1P1D not run: a dash
    spatial = {"spatial": "40/60", "a": {"ttft_p50_ms": 50.0}, "b": {"output_tok_s": 930.0}}
    lines = table(_report({"mixed": mixed, "pd-spatial": spatial})).splitlines()
    assert lines[0].split()[3:10] == ["mixed", "ratio", "1P1D", "ratio", "1P1D", "spatial",
                                      "ratio"]
    assert "0.930" in next(x for x in lines if x.startswith("(b)"))
    assert "40/60" in lines[-1]
    pd = {"spatial": "100/100", "a": {"ttft_p50_ms": 49.0}, "b": {"output_tok_s": 920.0}}
    sliced = {"spatial": "", "a": {"ttft_p50_ms": 50.0}, "b": {"output_tok_s": 850.0}}
    lines = table(_report({"mixed": mixed, "pd": pd, "pd-timesliced": sliced})).splitlines()
    assert lines[0].split()[5:10] == ["1P1D", "ratio", "1P1D", "time-sliced", "ratio"]
    split = lines[-1].split()
    assert split[:4] == ["1P1D", "SM", "split", "(prefill/decode"]
    assert split[-2:] == ["100/100", "off"]


def test_unknown_topology_is_refused_before_anything_runs(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit):
        main(["--topologies", "mixed,spatial", "--out", str(tmp_path / "o")])
    assert "unknown spatial (choose from mixed, pd, pd-timesliced, pd-spatial)" in \
        capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_every_topology_has_a_cluster_a_target_and_a_label() -> None:
    from pdserve.bench.serve_cluster import TOPOLOGIES
    from pdserve.bench.serve_compare import LABELS, TARGETS

    assert set(TOPOLOGIES) == set(TARGETS) == set(LABELS)


def test_sm_split_becomes_the_spatial_cluster_flags(capsys, tmp_path) -> None:
    from pdserve.bench.serve_compare import spatial_flags

    assert spatial_flags("") == []
    assert spatial_flags("0.5/1.0") == ["--prefill-sm-share=0.5", "--decode-sm-share=1.0"]
    for bad in ("0.5", "0.5/0", "x/1", "0.5/1.5"):
        with pytest.raises(ValueError):
            spatial_flags(bad)
    with pytest.raises(SystemExit):
        main(["--sm-split", "0.4", "--out", str(tmp_path / "o")])
    assert "--sm-split: expected P/D" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

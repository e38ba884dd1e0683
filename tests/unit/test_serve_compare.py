"""serve-bench's workload choice: built-in sizes, or the user's `--workloads`."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.serve_compare import (
    GPU_WORKLOADS,
    QUICK_WORKLOADS,
    Workload,
    add_workload_args,
    parse_workloads,
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

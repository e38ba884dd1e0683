"""Spatial P/D set-up on a machine without CUDA: worker shares, the MPS daemon's lifecycle
(through a stand-in binary), and the plain path with its message wherever MPS cannot work."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest
from fixtures.fake_mps import PLAIN_CONTEXT_ARGV, alive, start_server_argv, write_fake_mps

from pdserve.spatial import MpsDaemon, plan_spatial
from pdserve.worker.main import parser as worker_parser
from pdserve.worker.sm_share import (
    PCT_ENV,
    PID_FILE,
    PIPE_ENV,
    apply_sm_share,
    daemon_pid,
    percentage,
)


def test_sm_share_flag_and_warnings(tmp_path):
    args = worker_parser("decode").parse_args(["--sm-share", "0.6"])
    assert args.sm_share == 0.6 and worker_parser("prefill").parse_args([]).sm_share == 1.0
    assert percentage(0.4) == 40 and percentage(0.001) == 1 and percentage(1.0) == 100
    env: dict[str, str] = {PIPE_ENV: str(tmp_path)}
    assert apply_sm_share(1.0, "cuda", env) is None and PCT_ENV not in env  # no cap asked
    assert "ignored on cpu" in apply_sm_share(0.5, "cpu", env) and PCT_ENV not in env
    warning = apply_sm_share(0.4, "cuda", env)  # no daemon: CUDA would ignore the cap
    assert env[PCT_ENV] == "40" and "no MPS control daemon" in warning
    assert str(tmp_path) in warning and "time-sliced" in warning
    (tmp_path / PID_FILE).write_text(str(os.getpid()))  # a live daemon serves that directory
    assert daemon_pid(str(tmp_path)) == os.getpid()
    assert apply_sm_share(0.6, "cuda:0", env) is None and env[PCT_ENV] == "60"
    (tmp_path / PID_FILE).write_text("999999999")  # a stale pid file
    assert daemon_pid(str(tmp_path)) is None
    with pytest.raises(ValueError, match="sm_share"):
        apply_sm_share(0.0, "cuda", env)


def test_plain_path_reasons(tmp_path, monkeypatch):
    assert plan_spatial("cpu", 0, 0.4, 0.6) == (None, "needs --device cuda (got cpu)")
    assert plan_spatial("cuda", 0, 0.4, 0.6)[1] == "no CUDA device is visible"
    monkeypatch.setenv("PATH", str(tmp_path))  # no MPS binary on PATH
    plan, why = plan_spatial("cuda", 1, 0.4, 0.6)
    assert plan is None and "nvidia-cuda-mps-control is not on PATH" in why


@pytest.mark.timeout(60)
def test_own_daemon_started_probed_and_stopped(tmp_path, monkeypatch, short_tmp):
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.setattr("pdserve.worker.sm_share.DRIVER_PIPE_DIR", str(tmp_path / "none"))
    binary = write_fake_mps(str(tmp_path))
    daemon = MpsDaemon.start(binary)
    try:
        assert daemon.owned and daemon.tmp_dir and os.path.isdir(daemon.pipe_dir)
        pid = daemon_pid(daemon.pipe_dir)
        assert pid is not None and daemon.env[PIPE_ENV] == daemon.pipe_dir
        assert daemon.probe(start_server_argv(daemon.pipe_dir)) is None
        assert len(daemon.server_pids) == 1
    finally:
        daemon.stop()
    # The daemon and its server are gone, and so is the temporary directory.
    server = next(iter(daemon.server_pids))
    deadline = time.monotonic() + 5
    while (alive(pid) or alive(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid) and not alive(server)
    assert daemon.tmp_dir is None and not os.path.exists(os.path.dirname(daemon.pipe_dir))


@pytest.mark.timeout(60)
def test_own_daemon_quits_when_the_launcher_dies(tmp_path, monkeypatch, short_tmp):
    """The guard quits the daemon once the lifeline's write end is gone (as when the launcher
    is killed), and removes its directory; a daemon that is not ours gets no guard."""
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.setattr("pdserve.worker.sm_share.DRIVER_PIPE_DIR", str(tmp_path / "none"))
    binary = write_fake_mps(str(tmp_path))
    daemon = MpsDaemon.start(binary)
    read_fd, write_fd = os.pipe()
    try:
        pid = daemon_pid(daemon.pipe_dir)
        guard = daemon.guard(read_fd)
        assert guard is not None and pid is not None
        time.sleep(0.5)
        assert guard.poll() is None and daemon_pid(daemon.pipe_dir) == pid  # launcher alive
        os.close(write_fd)
        write_fd = -1
        assert guard.wait(20) == 0
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:  # it exits just after its pid file
            time.sleep(0.05)
        assert not alive(pid) and not os.path.exists(daemon.tmp_dir)
        assert MpsDaemon(binary, daemon.pipe_dir, None, owned=False).guard(read_fd) is None
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        daemon.stop()


@pytest.fixture
def short_tmp(monkeypatch):
    """A short temporary root (MPS pipe paths must stay short) that the test can list."""
    root = tempfile.mkdtemp(prefix="t", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(120)
def test_probe_without_a_server_takes_the_plain_path(tmp_path, monkeypatch, short_tmp):
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.setattr("pdserve.worker.sm_share.DRIVER_PIPE_DIR", str(tmp_path / "none"))
    binary = write_fake_mps(str(tmp_path))
    # A client whose context did not go through MPS (an old driver): no server appears.
    plan, why = plan_spatial("cuda", 1, 0.4, 0.6, binary, probe_argv=PLAIN_CONTEXT_ARGV)
    assert plan is None and "did not start an MPS server" in why and "control.log" in why
    # A client that fails outright: the real probe, on a torch without CUDA.
    plan, why = plan_spatial("cuda", 1, 0.4, 0.6, binary)
    assert plan is None and "a CUDA context under MPS failed (exit 1)" in why
    # A client that hangs in CUDA initialisation is killed after the probe's timeout.
    monkeypatch.setattr("pdserve.spatial.PROBE_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    plan, why = plan_spatial("cuda", 1, 0.4, 0.6, binary, probe_argv=["sleep", "30"])
    assert plan is None and "failed (exit -9)" in why and time.monotonic() - t0 < 15
    assert os.listdir(short_tmp) == []  # each daemon quit and its directory went with it


@pytest.mark.timeout(60)
def test_a_running_daemon_is_used_and_left_running(tmp_path, monkeypatch, short_tmp):
    binary = write_fake_mps(str(tmp_path))
    own = MpsDaemon.start(binary)
    try:
        monkeypatch.setenv(PIPE_ENV, own.pipe_dir)
        plan, how = plan_spatial("cuda", 1, 0.3, 0.7, binary,
                                 probe_argv=start_server_argv(own.pipe_dir))
        assert plan is not None and f"the MPS control daemon at {own.pipe_dir}" in how
        assert "30%" in how and "70%" in how
        assert plan.worker_args("prefill") == ["--sm-share", "0.3"]
        assert plan.worker_args("decode") == ["--sm-share", "0.7"]
        assert plan.worker_args("mixed") == []
        plan.close()  # not ours: still running
        assert daemon_pid(own.pipe_dir) is not None
    finally:
        own.stop()
    assert daemon_pid(own.pipe_dir) is None


def test_launcher_share_flags(capsys):
    from pdserve.launcher import DEFAULT_SM_SHARE, _parser, main, resolve_shares

    def shares(*argv: str) -> tuple[bool | None, float, float]:
        args = _parser().parse_args(list(argv))
        resolve_shares(args)
        return args.spatial, args.prefill_sm_share, args.decode_sm_share

    assert shares() == (None, DEFAULT_SM_SHARE, DEFAULT_SM_SHARE)  # auto; no caps
    assert shares("--spatial") == (True, 1.0, 1.0)
    assert shares("--no-spatial") == (False, 1.0, 1.0)
    assert shares("--prefill-sm-share", "0.4") == (None, 0.4, 0.6)  # decode: the rest
    assert shares("--spatial", "--prefill-sm-share", "0.7", "--decode-sm-share", "1") == (
        True, 0.7, 1.0)
    for bad in (["--prefill-sm-share", "1.5"], ["--prefill-sm-share", "0"],
                ["--decode-sm-share", "-0.2"]):
        assert main(["--spatial", *bad]) == 2
    err = capsys.readouterr().err
    assert "prefill_sm_share: must be in (0, 1]" in err and "decode_sm_share" in err


def test_a_daemon_that_does_not_start(tmp_path, monkeypatch, short_tmp):
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.setattr("pdserve.worker.sm_share.DRIVER_PIPE_DIR", str(tmp_path / "none"))
    broken = tmp_path / "nvidia-cuda-mps-control"
    broken.write_text("#!/bin/sh\necho 'An instance of this daemon is already running' >&2\n"
                      "exit 1\n")
    broken.chmod(0o755)
    plan, why = plan_spatial("cuda", 1, 0.5, 0.5, str(broken))
    assert plan is None and why.startswith("the MPS control daemon did not start")
    assert "exited with 1: An instance of this daemon is already running" in why
    assert os.listdir(short_tmp) == []


def test_which_workers_share_a_gpu():
    from pdserve.launcher import assign_gpus, shares_a_gpu

    tp1 = {"prefill": 1, "decode": 1, "mixed": 1}
    pd = ["prefill", "decode"]
    assert assign_gpus(pd, tp1, 1) == [(0,), (0,)] and shares_a_gpu(pd, [(0,), (0,)])
    assert assign_gpus(pd, tp1, 2) == [(0,), (1,)]
    assert not shares_a_gpu(pd, assign_gpus(pd, tp1, 2))
    assert assign_gpus(pd, tp1, 0) == [(), ()] and not shares_a_gpu(pd, [(), ()])  # CPU
    # TP 2 prefill + TP 1 decode on 2 GPUs: the decode worker wraps round onto GPU 0.
    tps = {"prefill": 2, "decode": 1, "mixed": 1}
    assert assign_gpus(pd, tps, 2) == [(0, 1), (0,)] and shares_a_gpu(pd, [(0, 1), (0,)])
    mixed = ["mixed", "mixed"]
    assert not shares_a_gpu(mixed, assign_gpus(mixed, tp1, 1))  # nothing to split

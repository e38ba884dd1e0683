"""kvtransfer/trace.py: the stage summary over lines from two processes' stderr."""

from __future__ import annotations

from pdserve.kvtransfer.trace import summarize


def test_summary_takes_medians_between_the_stages_each_room_passed() -> None:
    lines = []
    for room, (t0, write_ms) in enumerate([(10.0, 0.5), (20.0, 0.7), (30.0, 0.9)]):
        lines += [f"kvtrace send {room} {t0:.6f}",
                  f"kvtrace dequeue {room} {t0 + 0.0001:.6f}",
                  f"kvtrace launched {room} {t0 + 0.0001 + write_ms / 1e3:.6f}",
                  f"kvtrace success {room} {t0 + 0.003:.6f}"]
    lines[0] = "kvbench:  50%|#####     | 1/2 [00:01<00:01]" + lines[0]  # a progress bar's \r
    lines.append("kvtrace gpu_copy_ms 1 1.5000")
    lines.append("unrelated output")
    out = summarize(lines)
    assert out["send->dequeue"] == 0.1
    assert out["dequeue->launched"] == 0.7  # the median of 0.5, 0.7, 0.9
    assert out["launched->success"] == round(3.0 - 0.1 - 0.7, 3)
    assert out["gpu_copy_ms"] == 1.5
    assert "launched->notified" not in out
    assert out["first dequeue->launched"] == 0.5  # room 0, sent first
    assert out["first send->dequeue"] == 0.1 and "first gpu_copy_ms" not in out


def test_pdserve_kvtrace_prints_the_summary(tmp_path, capsys) -> None:  # noqa: ANN001
    import json

    from pdserve.cli import main

    log = tmp_path / "trace.log"
    log.write_text("kvtrace send 7 1.000000\nkvtrace success 7 1.002500\n")
    assert main(["kvtrace", str(log)]) == 0
    assert json.loads(capsys.readouterr().out) == {"send->success": 2.5}

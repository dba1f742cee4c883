"""`trainyard status` and heartbeats: progress, ETA, checkpoint, silent ranks, lost peers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import trainyard
from trainyard.errors import ConfigError
from trainyard.status import Heartbeat, format_status, lost_peer_error, read_heartbeats, read_status, write_heartbeat


def make_run(run_dir: Path, steps: list[int], start: float, seconds_per_step: float = 2.0, max_steps: int = 100) -> None:
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"run_name: r\ntrain:\n  max_steps: {max_steps}\n")
    lines = [
        {"kind": "train", "time": start + step * seconds_per_step, "step": step, "loss": 3.0 - step / 100, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 1234.0}
        for step in steps
    ]
    lines.insert(1, {"kind": "eval", "time": start + 1, "step": steps[0], "eval_loss": 2.5})
    lines.append({"kind": "checkpoint", "time": start + steps[-1] * seconds_per_step, "step": steps[-1]})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"kind": "tra')  # a half-written line
    (run_dir / "checkpoints" / "LATEST").write_text("step-00000040\n")


def test_progress_eta_and_checkpoint(tmp_path: Path) -> None:
    start = 1_000_000.0
    make_run(tmp_path, list(range(10, 50, 10)), start)
    status = read_status(tmp_path, now=start + 100)
    assert status["step"] == 40 and status["max_steps"] == 100 and status["loss"] == pytest.approx(2.6)
    assert status["seconds_per_step"] == pytest.approx(2.0)
    assert status["eta_s"] == pytest.approx(60 * 2.0)
    assert status["last_checkpoint"] == "step-00000040" and status["last_eval"]["eval_loss"] == 2.5
    assert status["finished"] is False
    text = format_status(status)
    assert "running, step 40/100" in text and "ETA 2m00s" in text and "step-00000040" in text and "1234 tokens/s" in text


def test_silent_ranks_are_named(tmp_path: Path) -> None:
    make_run(tmp_path, [1, 2], time.time() - 10)
    Heartbeat(tmp_path, 0).start().stop()
    write_heartbeat(tmp_path, 1, step=2)
    stale = json.loads((tmp_path / "heartbeats" / "rank-1.json").read_text())
    stale.update(time=time.time() - 300, node=1, host="gpu7")
    (tmp_path / "heartbeats" / "rank-1.json").write_text(json.dumps(stale))
    status = read_status(tmp_path, stale_after_s=60)
    assert status["stale_ranks"] == [1]
    assert "SILENT: rank 1 (node 1, host gpu7; silent 300 s, last at step 2)" in format_status(status)


def test_finished_run_reports_no_silent_ranks(tmp_path: Path) -> None:
    make_run(tmp_path, [1, 2], time.time() - 1000)
    write_heartbeat(tmp_path, 0, step=2)
    beat = json.loads((tmp_path / "heartbeats" / "rank-0.json").read_text())
    (tmp_path / "heartbeats" / "rank-0.json").write_text(json.dumps({**beat, "time": 1.0}))
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 2}))
    status = read_status(tmp_path)
    assert status["finished"] and status["stale_ranks"] == [] and status["eta_s"] is None


def test_heartbeat_thread_keeps_beating(tmp_path: Path) -> None:
    beat = Heartbeat(tmp_path, 3, interval_s=0.05).start()
    beat.step = 17
    first = read_heartbeats(tmp_path)[0]["time"]
    time.sleep(0.3)
    beat.stop()
    latest = read_heartbeats(tmp_path)[0]
    assert latest["time"] > first and latest["step"] == 17 and latest["rank"] == 3 and set(latest) >= {"host", "pid"}


def test_lost_peer_error_names_the_silent_ranks(tmp_path: Path) -> None:
    alive = Heartbeat(tmp_path, 0, interval_s=0.05).start()
    write_heartbeat(tmp_path, 2, step=40)
    err = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.123.0.2]:51367: Connection reset by peer")
    try:
        found = lost_peer_error(tmp_path, err, rank=0, wait_s=0.3)
    finally:
        alive.stop()
    assert found is not None
    text = found.render()
    assert "rank 0 lost contact with rank 2" in text and "last at step 40" in text and "10.123.0.2:51367" in text
    assert lost_peer_error(tmp_path, ValueError("shape mismatch"), rank=0, wait_s=0) is None


def test_missing_run_dir_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_status(tmp_path / "nope")


def test_cli_json(tmp_path: Path) -> None:
    make_run(tmp_path, [5, 10], time.time() - 30)
    result = trainyard("status", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == 10
    result = trainyard("status", str(tmp_path / "absent"))
    assert result.returncode == 2 and "does not exist" in result.stderr

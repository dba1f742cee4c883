"""`trainyard status`: progress, ETA, last checkpoint and silent ranks from a run dir alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.unit.runs.dpo_run import pair_figures, write_dpo_run
from trainyard.errors import ConfigError
from trainyard.preference.loss import STATS
from trainyard.runs import layout as run_layout
from trainyard.runs.status import (
    BackgroundHeartbeat,
    describe_ranks,
    format_status,
    read_heartbeats,
    read_status,
    silent_ranks,
)


def make_run(
    run_dir: Path, steps: list[int], start: float, seconds_per_step: float = 2.0, max_steps: int = 100
) -> None:
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"run_name: r\ntrain:\n  max_steps: {max_steps}\n")
    lines = [
        {
            "kind": "train",
            "time": start + step * seconds_per_step,
            "step": step,
            "loss": 3.0 - step / 100,
            "lr": 1e-4,
            "grad_norm": 1.0,
            "tokens_per_s": 1234.0,
        }
        for step in steps
    ]
    lines.insert(1, {"kind": "eval", "time": start + 1, "step": steps[0], "eval_loss": 2.5})
    lines.append({"kind": "checkpoint", "time": start + steps[-1] * seconds_per_step, "step": steps[-1]})
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines) + '{"kind": "tra'
    )  # a half-written line
    (run_dir / "checkpoints" / "LATEST").write_text("step-00000040\n")


def beat(run_dir: Path, rank: int, step: int, at: float, host: str = "gpu7") -> None:
    """A heartbeat as the trainer writes it."""
    (run_dir / "heartbeats").mkdir(exist_ok=True)
    record = {"rank": rank, "host": host, "pid": 1000 + rank, "step": step, "time": at}
    (run_dir / "heartbeats" / f"rank-{rank}.json").write_text(json.dumps(record))


def test_progress_eta_and_checkpoint(tmp_path: Path) -> None:
    start = 1_000_000.0
    make_run(tmp_path, list(range(10, 50, 10)), start)
    status = read_status(tmp_path, now=start + 100)
    assert status["step"] == 40 and status["max_steps"] == 100 and status["loss"] == pytest.approx(2.6)
    assert status["seconds_per_step"] == pytest.approx(2.0)
    assert status["eta_s"] == pytest.approx(60 * 2.0)
    assert status["last_checkpoint"] == "step-00000040" and status["last_eval"]["eval_loss"] == 2.5
    assert status["finished"] is False and status["state"] == "running"
    text = format_status(status)
    assert (
        "running, step 40/100" in text and "ETA 2m00s" in text and "step-00000040" in text and "1234 tokens/s" in text
    )


def test_silent_ranks_are_named(tmp_path: Path) -> None:
    now = time.time()
    make_run(tmp_path, [1, 2], now - 10)
    beat(tmp_path, 0, 2, now - 1, host="gpu1")
    beat(tmp_path, 1, 2, now - 2, host="gpu1")
    beat(tmp_path, 2, 1, now - 300)
    beat(tmp_path, 3, 1, now - 290)
    status = read_status(tmp_path, stale_after_s=60, now=now)
    assert status["stale_ranks"] == [2, 3]
    assert "SILENT: ranks 2, 3 (host gpu7; silent 300 s, last at step 1)" in format_status(status)
    assert read_status(tmp_path, stale_after_s=600, now=now)["stale_ranks"] == []


def test_finished_run_reports_no_silent_ranks(tmp_path: Path) -> None:
    make_run(tmp_path, [1, 2], time.time() - 1000)
    beat(tmp_path, 0, 2, 1.0)
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 2}))
    status = read_status(tmp_path)
    assert status["finished"] and status["state"] == "finished"
    assert status["stale_ranks"] == [] and status["eta_s"] is None
    assert "finished, step 2/100" in format_status(status)


def test_a_run_no_rank_ever_logged_is_not_started(tmp_path: Path) -> None:
    """It said "running" for a run dir holding only the config the job wrote before it failed or was queued."""
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 5\n")
    status = read_status(tmp_path)
    assert status["state"] == "not started" and status["step"] is None and status["last_checkpoint"] is None
    assert "not started, no rank has logged a step or a heartbeat yet" in format_status(status)
    assert "running" not in format_status(status)


def test_a_heartbeat_before_the_first_step_is_running(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 5\n")
    beat(tmp_path, 0, 0, time.time())
    status = read_status(tmp_path)
    assert status["state"] == "running" and status["step"] is None
    assert "running, no train step logged yet" in format_status(status)


def test_cli_json_says_not_started(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from trainyard.cli import app

    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 5\n")
    result = CliRunner().invoke(app, ["status", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["state"] == "not started"
    result = CliRunner().invoke(app, ["status", str(tmp_path)])
    assert "not started" in result.output


def test_missing_run_dir_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_status(tmp_path / "nope")


def test_cli_text_and_json(tmp_path: Path) -> None:
    make_run(tmp_path, [5, 10], time.time() - 30)
    result = run_cli("status", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == 10
    result = run_cli("status", str(tmp_path / "absent"))
    assert result.returncode == 2 and "does not exist" in " ".join(result.stderr.split())


def test_background_heartbeat_beats_while_the_main_thread_is_busy(tmp_path: Path) -> None:
    heartbeat = BackgroundHeartbeat(tmp_path, 3, interval_s=0.05).start()
    heartbeat.step = 17
    first = read_heartbeats(tmp_path)[0]["time"]
    time.sleep(0.3)  # stands for a rank blocked in a collective
    heartbeat.stop()
    latest = read_heartbeats(tmp_path)[0]
    assert latest["time"] > first and latest["step"] == 17 and latest["rank"] == 3 and {"host", "pid"} <= set(latest)


def test_silent_ranks_tells_a_killed_process_from_a_blocked_one(tmp_path: Path) -> None:
    """Rank 1 lives in another process that is SIGKILLed; rank 2 is alive but idle."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from trainyard.runs.status import BackgroundHeartbeat as B; "
            f"B({str(tmp_path)!r}, 1, 0.05).start(); print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "up"
    alive = BackgroundHeartbeat(tmp_path, 2, interval_s=0.05).start()
    own = BackgroundHeartbeat(tmp_path, 0, interval_s=0.05).start()
    child.send_signal(signal.SIGKILL)
    child.wait()
    try:
        lost = silent_ranks(tmp_path, own_rank=0, wait_s=0.4)
    finally:
        alive.stop()
        own.stop()
    assert [beat["rank"] for beat in lost] == [1]
    assert describe_ranks(lost, time.time()).startswith("rank 1 (host ")


def test_stopping_the_heartbeat_writes_a_last_beat_at_the_step_reached(tmp_path: Path) -> None:
    """A preemption stops the loop between beats: the last beat must say the step it stopped at, not the one of
    up to an interval before."""
    heartbeat = BackgroundHeartbeat(tmp_path, rank=3, interval_s=3600).start()
    heartbeat.step = 41
    heartbeat.stop()
    beats = read_heartbeats(tmp_path)
    assert [(b["rank"], b["step"]) for b in beats] == [(3, 41)]


def test_each_rank_is_listed_with_its_host_and_pid(tmp_path: Path) -> None:
    """Which PID is rank 3 of this job: the heartbeats say, and status lists them by host (this process's own
    beat, as the trainer writes it, among ranks of another host)."""
    now = time.time()
    make_run(tmp_path, [1, 2], now - 10)
    own = BackgroundHeartbeat(tmp_path, rank=0, interval_s=3600).start()
    own.stop()
    beat(tmp_path, 1, 2, now - 1, host="gpu8")
    beat(tmp_path, 2, 2, now - 1, host="gpu8")
    status = read_status(tmp_path, now=now)
    assert [(b["rank"], b["host"], b["pid"]) for b in status["heartbeats"]] == [
        (0, socket.gethostname(), os.getpid()), (1, "gpu8", 1001), (2, "gpu8", 1002)]
    text = format_status(status)
    assert f"    host {socket.gethostname()}: rank 0 pid {os.getpid()}\n" in text, text
    assert "    host gpu8: rank 1 pid 1001, rank 2 pid 1002" in text, text


def test_a_dpo_run_shows_its_latest_rewards_train_and_eval(tmp_path: Path) -> None:
    """A DPO run is judged by its reward margin and accuracy, not its loss alone: status shows the newest train
    event's and the newest evaluation's."""
    run_dir = write_dpo_run(tmp_path, steps=6, eval_every=4)
    status = read_status(run_dir)
    train, held_out = pair_figures(6), pair_figures(4)
    assert status["objective_figures"] == pytest.approx(train, rel=1e-6)
    assert status["eval_objective_figures"] == pytest.approx(
        {f"eval_{name}": 0.9 * value for name, value in held_out.items()}, rel=1e-6)
    text = format_status(status)
    assert "  rewards (train): margins 0.24  accuracies 0.8  chosen 0.06  rejected -0.18\n" in text, text
    assert "  logps (train): chosen -40.6  rejected -43.4\n" in text, text
    assert "  last eval (step 4): eval_loss 0.7\n" in text, text
    assert "  rewards (eval, step 4): margins 0.144  accuracies 0.63  chosen 0.036  rejected -0.108\n" in text, text


def test_an_sft_run_shows_no_objective_figures(tmp_path: Path) -> None:
    make_run(tmp_path, [1, 2], time.time() - 10)
    status = read_status(tmp_path)
    assert status["objective_figures"] == {} and status["eval_objective_figures"] == {}
    assert "rewards" not in format_status(status)


def test_the_figures_status_and_report_read_are_those_dpo_logs() -> None:
    """runs/ never imports torch, so it names DPO's figures itself: they must stay the ones the loss computes."""
    assert set(run_layout.OBJECTIVE_FIGURES["dpo"]) == set(STATS)

"""Faults are found and named: a non-finite loss, a desynced replica, a stopped rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, events, trainyard

pytestmark = pytest.mark.dist

FAST = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false", "log.tensorboard=false"]


def test_injected_nan_stops_the_run_naming_step_and_rank(tmp_path: Path) -> None:
    result = trainyard(
        "train", TINY, f"output_dir={tmp_path}", "train.max_steps=6", *FAST, "--nproc", "2",
        env={"TRAINYARD_FAULT": "nan@rank1:step3"},
    )
    assert result.returncode == 1, result.stderr
    assert "non-finite loss or gradient at step 3" in result.stderr
    assert "rank(s) [1]" in result.stderr


def test_nan_step_is_skipped_when_configured(tmp_path: Path) -> None:
    result = trainyard(
        "train", TINY, f"output_dir={tmp_path}", "train.max_steps=5", "train.on_nonfinite=skip", *FAST,
        "--nproc", "2", env={"TRAINYARD_FAULT": "nan@rank0:step2"},
    )
    assert result.returncode == 0, result.stderr
    skipped = [e for e in events(tmp_path / "tiny", "system") if e.get("event") == "skipped_nonfinite_step"]
    assert [(e["step"], e["ranks"]) for e in skipped] == [(2, [0])]


def test_desynced_replica_is_detected(tmp_path: Path) -> None:
    result = trainyard(
        "train", TINY, f"output_dir={tmp_path}", "train.max_steps=8", "dist.desync_check_steps=4", *FAST,
        "--nproc", "2", env={"TRAINYARD_FAULT": "desync@rank1:step4"},
    )
    assert result.returncode == 1, result.stderr
    assert "replicas desynced at step 4" in result.stderr
    assert "rank 1:" in result.stderr


def test_healthy_replicas_pass_the_desync_check(tmp_path: Path) -> None:
    result = trainyard("train", TINY, f"output_dir={tmp_path}", "train.max_steps=4", "dist.desync_check_steps=2", *FAST, "--nproc", "2")
    assert result.returncode == 0, result.stderr


def test_stopped_rank_fails_the_job_within_the_timeout_naming_it(tmp_path: Path) -> None:
    timeout_s = 8
    command = [
        sys.executable, "-m", "trainyard.cli", "train", TINY, f"output_dir={tmp_path}", "train.max_steps=1000000",
        f"dist.timeout_s={timeout_s}", "log.every_steps=1000", *FAST, "--nproc", "2",
    ]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    heartbeat = tmp_path / "tiny" / "heartbeats" / "rank-1.json"
    deadline = time.monotonic() + 120
    while not heartbeat.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    stopped_pid = json.loads(heartbeat.read_text())["pid"]
    os.kill(stopped_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    stack = tmp_path / "tiny" / "logs" / "stack-rank-0.txt"
    while not stack.exists() and proc.poll() is None and time.monotonic() - stopped_at < timeout_s + 60:
        time.sleep(0.2)
    detected_after = time.monotonic() - stopped_at
    os.kill(stopped_pid, signal.SIGKILL)  # a stopped process ignores the launcher's SIGTERM
    try:
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "lost its peers" in stderr, stderr[-3000:]
    assert "ranks 1 did not arrive" in stderr, stderr[-3000:]
    assert stack.stat().st_size > 0
    assert detected_after < timeout_s + 30, f"detected after {detected_after:.0f}s"

"""Faults are found and named: a non-finite loss, a desynced replica, a stopped rank."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY, events, run_cli, trainyard
from tests.dist.stop_a_rank import stop_a_rank

pytestmark = pytest.mark.dist

FAST = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false", "log.tensorboard=false"]


def cmdline(pid: int) -> bytes:
    """What `ps` and py-spy show for a process: its /proc command line, without the padding a title leaves."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0")


def test_injected_nan_stops_the_run_naming_step_and_rank(tmp_path: Path) -> None:
    result = trainyard(
        "train",
        TINY,
        f"output_dir={tmp_path}",
        "train.max_steps=6",
        *FAST,
        "--nproc",
        "2",
        env={"TRAINYARD_FAULT": "nan@rank1:step3"},
    )
    assert result.returncode == 1, result.stderr
    assert "non-finite loss or gradient at step 3" in result.stderr
    assert "rank(s) [1]" in result.stderr


def test_desynced_replica_is_detected(tmp_path: Path) -> None:
    result = trainyard(
        "train",
        TINY,
        f"output_dir={tmp_path}",
        "train.max_steps=8",
        "dist.desync_check_steps=4",
        *FAST,
        "--nproc",
        "2",
        env={"TRAINYARD_FAULT": "desync@rank1:step4"},
    )
    assert result.returncode == 1, result.stderr
    assert "replicas desynced at step 4" in result.stderr
    assert "rank 1:" in result.stderr


def test_a_nan_step_is_skipped_when_configured_and_the_replicas_still_pass_the_desync_check(tmp_path: Path) -> None:
    """One run for both: every rank skips the step rank 0 found non-finite, so the replicas checked at steps 2
    and 4 still agree."""
    result = trainyard(
        "train",
        TINY,
        f"output_dir={tmp_path}",
        "train.max_steps=4",
        "train.on_nonfinite=skip",
        "dist.desync_check_steps=2",
        *FAST,
        "--nproc",
        "2",
        env={"TRAINYARD_FAULT": "nan@rank0:step3"},
    )
    assert result.returncode == 0, result.stderr
    skipped = [e for e in events(tmp_path / "tiny", "system") if e.get("event") == "skipped_nonfinite_step"]
    assert [(e["step"], e["ranks"]) for e in skipped] == [(3, [0])]


def test_stopped_rank_is_named_within_the_timeout_and_diagnosed(tmp_path: Path) -> None:
    """The issue's contract: a SIGSTOPped rank is reported within dist.timeout_s + 10 s, the
    original exception stays in the rank log, and the flight record names who did not join."""
    timeout_s = 8
    command = [
        sys.executable,
        "-m",
        "trainyard.cli",
        "train",
        TINY,
        f"output_dir={tmp_path}",
        "train.max_steps=1000000",
        f"dist.timeout_s={timeout_s}",
        "log.every_steps=1000",
        *FAST,
        "--nproc",
        "2",
    ]
    run_dir = tmp_path / "tiny"
    titles: dict[int, bytes] = {}
    code, stderr, after = stop_a_rank(command, run_dir / "heartbeats" / "rank-1.json",
                                      before_stop=lambda pid: titles.update({pid: cmdline(pid)}))
    [(stopped_pid, title)] = titles.items()
    assert title == b"trainyard train tiny rank 1/2"  # a worker forked from the fork server, named by the recipe
    assert code != 0
    assert after is not None, stderr[-3000:]
    assert after <= timeout_s + 10, f"reported {after:.0f}s after the stop"
    assert "ranks 1 did not arrive" in stderr, stderr[-3000:]
    assert (run_dir / "logs" / "stack-rank-0.txt").stat().st_size > 0
    logged = (run_dir / "logs" / "rank-0.log").read_text()
    assert "Traceback (most recent call last)" in logged, logged[-3000:]
    assert f"Timed out waiting {timeout_s * 1000}ms" in logged, logged[-3000:]

    report = json.loads(run_cli("diagnose", str(run_dir), "--json").stdout)
    hang = report["hangs"][0]
    assert hang["group_desc"] == "default_pg" and hang["entered"] == [0] and hang["no_record"] == [1]
    text = run_cli("diagnose", str(run_dir)).stdout
    assert f"ranks 1 did not join {hang['op']} #{hang['seq']} of group 0" in text, text
    assert "rank 1: left no flight record" in text, text
    assert f"pid {stopped_pid}: `py-spy dump --pid {stopped_pid}` on {socket.gethostname()}" in text, text
    status = run_cli("status", str(run_dir)).stdout
    assert "trainyard diagnose" in status and f"rank 1 pid {stopped_pid}" in status, status

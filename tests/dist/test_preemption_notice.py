"""Preemption is not an error: a stopped 2-rank run exits 75 with one notice line and no traceback."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.dist.checkpoint_helpers import LORA_DDP, kill_tree, last_step, start, train_args, wait_for_step
from trainyard.checkpoint.save import latest_full, step_dir
from trainyard.runs.status import read_heartbeats

pytestmark = pytest.mark.dist

NOTICE = re.compile(
    r"trainyard: preempted by SIG(?:TERM|USR1) after step (\d+); checkpoint step-(\d{8}) committed"
    r" — run the same command again to resume"
)


@pytest.mark.parametrize("command", ["train", "launch"])
def test_sigterm_after_a_save_is_one_notice_line_not_an_error(tmp_path: Path, command: str) -> None:
    """What a scheduler's stop signal leaves on the console: `train --nproc 2` runs the agent in
    this process, `launch` runs it as a child; torchrun reports a signal with a traceback."""
    # Far more steps than the run can take before the signal lands; the preemption save is the only one.
    args = train_args(tmp_path, *LORA_DDP, "train.max_steps=100000", "checkpoint.every_steps=0")
    if command == "launch":
        args = ["launch", *args[1:]]
    run_dir, checkpoints = tmp_path / "tiny", tmp_path / "tiny" / "checkpoints"
    proc = start(args)
    try:
        wait_for_step(proc, run_dir, 3)
        proc.send_signal(signal.SIGTERM)  # the launcher only, as a scheduler would; it forwards to the workers
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.returncode is None:
            kill_tree(proc)
    assert proc.returncode == 75, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith("trainyard:")]
    assert len(ours) == 1 and NOTICE.fullmatch(ours[0]), stderr[-3000:]
    step, saved = map(int, NOTICE.fullmatch(ours[0]).groups())
    assert step == saved == last_step(run_dir)
    assert latest_full(checkpoints) == step_dir(checkpoints, step)
    assert "Traceback" not in stderr and "Error" not in stderr and "error" not in stderr, stderr[-3000:]
    # Each rank's last beat, written on its way out, says where it stopped: `trainyard status` shows that step.
    assert [(beat["rank"], beat["step"]) for beat in read_heartbeats(run_dir)] == [(0, step), (1, step)]


def _signal_every_process(proc: psutil.Process, signum: int) -> None:
    try:
        children = proc.children(recursive=True)
    except psutil.NoSuchProcess:  # the launcher has ended and been reaped since the caller last looked
        return
    for process in [proc, *children]:
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_signal_to_every_process_again_and_again_is_acted_on_once(tmp_path: Path, command: str) -> None:
    """Slurm's --signal reaches every process of the step (launcher, agent, workers) and the launcher
    forwards it again, so the agent sees it several times. torch's agent raised on each delivery: a
    late one printed a traceback at exit, and `train --nproc` did not handle SIGUSR1 and died of it."""
    args = train_args(tmp_path, *LORA_DDP, "train.max_steps=100000", "checkpoint.every_steps=0")
    if command == "launch":
        args = ["launch", *args[1:]]
    run_dir, checkpoints = tmp_path / "tiny", tmp_path / "tiny" / "checkpoints"
    proc = start(args)
    try:
        wait_for_step(proc, run_dir, 3)
        launcher, deadline = psutil.Process(proc.pid), time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            _signal_every_process(launcher, signal.SIGUSR1)
            time.sleep(0.02)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.returncode is None:
            kill_tree(proc)
    assert proc.returncode == 75, stderr[-3000:]
    ours = [line for line in stderr.splitlines() if line.startswith("trainyard:")]
    assert len(ours) == 1 and NOTICE.fullmatch(ours[0]) and "SIGUSR1" in ours[0], stderr[-3000:]
    step = int(NOTICE.fullmatch(ours[0]).group(1))
    assert latest_full(checkpoints) == step_dir(checkpoints, step)
    assert "Traceback" not in stderr and "closing signal SIGTERM" not in stderr, stderr[-3000:]

"""dist.timeout_s reaches every process group of every mesh: torch's init_device_mesh gives the groups it splits off
its own default (30 minutes), so FSDP2's and HSDP's collectives and DiLoCo's site and local groups waited 30 minutes
while the failure message quoted dist.timeout_s."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY
from tests.dist.stop_a_rank import stop_a_rank

pytestmark = pytest.mark.dist


def test_every_group_of_every_mesh_carries_the_job_timeout(tmp_path: Path) -> None:
    out = tmp_path / "timeouts.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
         str(REPO / "tests" / "dist" / "scripts" / "mesh_timeouts.py"), str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    timeouts = json.loads(out.read_text())
    assert set(timeouts) >= {"hsdp.replicate", "hsdp.shard", "diloco.site", "diloco.local", "diloco-hsdp.shard",
                             "pairs-hsdp.replicate", "pairs-hsdp.shard", "pairs-ep.shard", "pairs-ep.ep",
                             "hsdp-cp.replicate", "hsdp-cp.shard", "hsdp-cp.cp"}
    assert timeouts == dict.fromkeys(timeouts, 123.0)  # the script's dist.timeout_s, on the default group too


def test_a_rank_stopped_inside_fsdp2_on_four_processes_is_named_within_the_timeout(tmp_path: Path) -> None:
    """HSDP on 2 x 2 ranks: most collectives of a step are all-gathers and reduce-scatters on the shard groups, split
    off the default group. The job ends, naming the rank, within dist.timeout_s + 10 s. (The ranks outside the
    stopped rank's shard group already reported in time through the default group's per-step vote before the mesh
    groups carried the timeout; the test above is the one that reads each group's timeout.)"""
    timeout_s = 10
    command = [sys.executable, "-m", "trainyard.cli", "train", TINY, f"output_dir={tmp_path}",
               "train.max_steps=1000000", "train.micro_batch_size=2", "train.global_batch_size=8", f"dist.timeout_s={timeout_s}",
               "dist.strategy=hsdp", "dist.shard_size=2", "log.every_steps=1000", "eval.every_steps=0", "eval.at_end=false",
               "checkpoint.at_end=false", "log.tensorboard=false", "--nproc", "4"]
    code, stderr, after = stop_a_rank(command, tmp_path / "tiny" / "heartbeats" / "rank-3.json", settle_s=1)
    assert code != 0
    assert after is not None, stderr[-3000:]
    assert after <= timeout_s + 10, f"reported {after:.0f}s after the stop"
    assert "3 did not arrive" in stderr, stderr[-3000:]

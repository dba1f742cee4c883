"""dist.network / dist.nic reach Gloo on every path: a NIC this host lacks fails process-group
creation with one clear message and exit 2, under `train --nproc` and a bare torchrun alike."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, assert_ok, trainyard

pytestmark = pytest.mark.dist

SHORT = ["train.max_steps=2", "eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false",
         "log.tensorboard=false"]


def bare_torchrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc-per-node 2 -m trainyard.cli ...`, as a user types it: no trainyard launcher."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "trainyard.cli", *args],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )


def flat(text: str) -> str:
    """The console wraps long lines anywhere; compare without whitespace."""
    return "".join(text.split())


def test_missing_nic_fails_train_nproc_with_exit_2(tmp_path: Path) -> None:
    result = trainyard("train", TINY, f"output_dir={tmp_path}", "dist.nic=nosuch0", *SHORT, "--nproc", "2")
    assert result.returncode == 2, result.stderr[-4000:]
    assert "override'dist.nic=nosuch0':dist.nic:networkinterface'nosuch0'doesnotexist" in flat(result.stderr)
    assert "lo(127.0.0.1)" in flat(result.stderr)  # the interfaces that do exist
    assert "Traceback" not in result.stderr and "enforce fail" not in result.stderr
    assert result.stderr.count("trainyard: error") == 1


def test_missing_nic_fails_a_bare_torchrun_worker_with_exit_2(tmp_path: Path) -> None:
    result = bare_torchrun("train", TINY, f"output_dir={tmp_path}", "dist.nic=nosuch0", *SHORT)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert re.search(r"exitcode\s*:\s*2\b", output), output[-4000:]  # torchrun's failure table shows the worker's 2
    assert "dist.nic:networkinterface'nosuch0'doesnotexist" in flat(output)
    # The only traceback is torchrun's own report of a failed child; no worker printed one.
    raised = re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*(.*)", output)
    failed_child = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
    assert all(line.startswith(failed_child) for line in raised), output[-4000:]
    assert "enforce fail" not in output and "ConfigError" not in output


def test_an_interface_variable_naming_no_nic_is_a_user_error(tmp_path: Path) -> None:
    """Set in the environment rather than the config: Gloo's own failure, named in our words."""
    job = ["train", TINY, f"output_dir={tmp_path}", *SHORT, "--nproc", "2"]
    result = trainyard(*job, env={"GLOO_SOCKET_IFNAME": "nosuch1"})
    assert result.returncode == 2, result.stderr[-4000:]
    assert "GLOO_SOCKET_IFNAME=nosuch1namesnonetworkinterface" in flat(result.stderr)
    assert "Traceback" not in result.stderr and "enforce fail" not in result.stderr


def test_a_real_nic_trains_under_a_bare_torchrun(tmp_path: Path) -> None:
    result = bare_torchrun("train", TINY, f"output_dir={tmp_path}", "dist.nic=lo", "dist.network=socket", *SHORT)
    assert_ok(result)
    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 2
    log = (tmp_path / "tiny" / "logs" / "rank-0.log").read_text()
    assert "'GLOO_SOCKET_IFNAME': 'lo'" in log and "'NCCL_NET': 'Socket'" in log

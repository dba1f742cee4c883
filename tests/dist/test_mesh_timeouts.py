"""dist.timeout_s reaches every process group of every mesh: torch's init_device_mesh gives the groups it splits off
its own default (30 minutes), so FSDP2's and HSDP's collectives and DiLoCo's site and local groups waited 30 minutes
while the failure message quoted dist.timeout_s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

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
    assert set(timeouts) >= {"hsdp.replicate", "hsdp.shard", "diloco.site", "diloco.local", "diloco-hsdp.shard"}
    assert timeouts == dict.fromkeys(timeouts, 123.0)  # the script's dist.timeout_s, on the default group too

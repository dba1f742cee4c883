"""A lite save copies the LoRA adapter to rank 0's host alone: every other rank's host keeps only its shard
(seed 000's GLM-4.5-Air adapter was 7.3 GB a rank), and rank 0's copy equals the unsharded adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.dist

SCRIPT = REPO / "tests" / "dist" / "scripts" / "adapter_state_two_ranks.py"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What `adapter_state` held on each of 2 FSDP2 ranks of the tiny LoRA job."""
    out = tmp_path_factory.mktemp("adapter-gather")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT), str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


def test_rank_1_holds_no_adapter_tensor(reports: list[dict]) -> None:
    assert (reports[1]["tensors"], reports[1]["bytes"]) == (0, 0)


def test_rank_0_holds_the_whole_adapter_on_the_host_equal_to_the_unsharded_one(reports: list[dict]) -> None:
    main = reports[0]
    assert main["names_match"] and main["tensors"] > 0
    assert main["bytes"] == main["reference_bytes"] and main["devices"] == ["cpu"]
    assert main["max_diff"] == 0.0


def test_the_saved_adapter_equals_the_unsharded_one(reports: list[dict]) -> None:
    assert reports[0]["saved_max_diff"] == 0.0

"""An evaluation makes exactly one collective, whatever the number of batches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_collective_per_evaluation(tmp_path: Path, strategy: str) -> None:
    out = tmp_path / "counts.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "tests" / "dist" / "scripts" / "count_eval_collectives.py"), str(tmp_path), strategy, str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    counts = json.loads(out.read_text())
    # 37 examples over 2 ranks in batches of 4: 5 batches per rank, uneven shards.
    assert counts["batches_per_rank"] == 5
    assert counts["explicit_collectives"] == {"all_reduce": 1}
    assert counts["examples"] == 37

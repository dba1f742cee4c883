"""Real flight records from a 2-rank Gloo job: `trainyard diagnose` names the rank that did not
join, the collective and its sequence number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, trainyard

pytestmark = pytest.mark.dist


def _two_ranks(run_dir: Path, mode: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "tests" / "dist" / "scripts" / "flight_behind.py"), str(run_dir), mode],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in (run_dir / "flight").iterdir()) == ["gloo-rank-0", "gloo-rank-1"]


def test_diagnose_names_the_rank_behind_and_the_collective_it_missed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _two_ranks(run_dir, "behind")

    report = json.loads(trainyard("diagnose", str(run_dir), "--json").stdout)
    hang = report["hangs"][0]
    assert (hang["op"], hang["seq"], hang["group_desc"]) == ("all_reduce", 4, "default_pg")
    assert hang["entered"] == [0]
    assert hang["behind"] == {"1": {"last_seq": 3, "last_op": "all_reduce"}}
    assert any("flight_behind.py" in frame for frame in hang["stack"])

    text = trainyard("diagnose", str(run_dir)).stdout
    assert "ranks 1 did not join all_reduce #4 of group 0 (default_pg, gloo)" in text, text
    assert "rank 1: last entered all_reduce #3" in text, text


def test_diagnose_names_ranks_that_called_different_collectives(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _two_ranks(run_dir, "mismatch")
    report = json.loads(trainyard("diagnose", str(run_dir), "--json").stdout)
    hang = report["hangs"][0]
    assert hang["seq"] == 4 and hang["entered"] == [0, 1] and not hang["behind"]
    assert hang["mismatched"] == {
        "0": {"op": "all_reduce", "input_sizes": [[3]]},
        "1": {"op": "broadcast", "input_sizes": [[5]]},
    }
    text = trainyard("diagnose", str(run_dir)).stdout
    assert "different collectives at #4: rank 0: all_reduce [[3]]; rank 1: broadcast [[5]]" in text, text

"""Real flight records from a 2-rank Gloo job: `trainyard diagnose` names the rank that did not
join, the collective and its sequence number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def flight_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both ways at once, each a 2-rank job of its own: each spends most of its time waiting out its timeout."""
    root = tmp_path_factory.mktemp("flight")
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             str(REPO / "tests" / "dist" / "scripts" / "flight_behind.py"), str(root / mode), mode],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )
        for mode in ("behind", "mismatch")
    }
    try:
        for mode, proc in procs.items():
            _, stderr = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"{mode}: {stderr[-4000:]}"
            assert sorted(p.name for p in (root / mode / "flight").iterdir()) == ["gloo-rank-0", "gloo-rank-1"]
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.kill()
                proc.communicate()
    return {mode: root / mode for mode in procs}


def test_diagnose_names_the_rank_behind_and_the_collective_it_missed(flight_runs: dict[str, Path]) -> None:
    run_dir = flight_runs["behind"]
    report = json.loads(run_cli("diagnose", str(run_dir), "--json").stdout)
    hang = report["hangs"][0]
    assert (hang["op"], hang["seq"], hang["group_desc"]) == ("all_reduce", 4, "default_pg")
    assert hang["entered"] == [0]
    assert hang["behind"] == {"1": {"last_seq": 3, "last_op": "all_reduce"}}
    assert any("flight_behind.py" in frame for frame in hang["stack"])

    text = run_cli("diagnose", str(run_dir)).stdout
    assert "ranks 1 did not join all_reduce #4 of group 0 (default_pg, gloo)" in text, text
    assert "rank 1: last entered all_reduce #3" in text, text


def test_diagnose_names_ranks_that_called_different_collectives(flight_runs: dict[str, Path]) -> None:
    run_dir = flight_runs["mismatch"]
    report = json.loads(run_cli("diagnose", str(run_dir), "--json").stdout)
    hang = report["hangs"][0]
    assert hang["seq"] == 4 and hang["entered"] == [0, 1] and not hang["behind"]
    assert hang["mismatched"] == {
        "0": {"op": "all_reduce", "input_sizes": [[3]]},
        "1": {"op": "broadcast", "input_sizes": [[5]]},
    }
    text = run_cli("diagnose", str(run_dir)).stdout
    assert "different collectives at #4: rank 0: all_reduce [[3]]; rank 1: broadcast [[5]]" in text, text

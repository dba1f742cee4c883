"""`trainyard launch --nnodes MIN:MAX`: every node count in the range must keep the global batch, checked before
anything starts (a restart on one that cannot would exit 2 hours in)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli
from trainyard.config_file import load_config
from trainyard.errors import ConfigError
from trainyard.launch.torchrun import check_node_range, resolve_plan

ELASTIC = ("--rdzv", "c10d", "--rdzv-id", "range-check", "--master", "127.0.0.1:29400", "--nproc", "2")


def test_a_range_with_a_node_count_that_cannot_keep_the_batch_exits_2_naming_those_that_can(tmp_path: Path) -> None:
    # tiny: micro-batches of 8; 16 samples per step fit 1 node x 2 processes (accumulation 1), not 4 or 6 ranks
    out = tmp_path / "runs"
    result = run_cli("launch", TINY, f"output_dir={out}", "train.global_batch_size=16", "--nnodes", "1:3", *ELASTIC)
    message = " ".join(result.stderr.split())
    assert result.returncode == 2, message
    assert "Traceback" not in message
    assert "train.global_batch_size=16" in message and "node counts that keep it: 1 (world 2)" in message, message
    assert "running:" not in message and not (out / "tiny").exists(), "something started before the check"


def test_an_elastic_range_without_a_global_batch_exits_2_with_one_that_fits_every_size() -> None:
    result = run_cli("launch", TINY, "train.global_batch_size=null", "--nnodes", "1:2", *ELASTIC)
    message = " ".join(result.stderr.split())
    assert result.returncode == 2 and "Traceback" not in message, message
    assert "train.global_batch_size is unset" in message, message
    assert "multiple of micro_batch_size x 4 = 32" in message, message  # lcm of worlds 2 and 4, x micro 8


@pytest.mark.parametrize(("nnodes", "batch"), [("1:2", 32), ("2", 16), ("1:4", 192)])
def test_sizes_that_all_keep_the_batch_pass(nnodes: str, batch: int) -> None:
    cfg = load_config(TINY, [f"train.global_batch_size={batch}"])
    check_node_range(cfg, resolve_plan(nnodes=nnodes, rdzv="c10d", rdzv_id="x", master="h:1", nproc="2", env={}))


def test_the_tokens_budget_is_checked_too() -> None:
    cfg = load_config(TINY, ["train.global_batch_tokens=1664"])  # 8 x 2 ranks x 104 tokens: only world 2
    plan = resolve_plan(nnodes="1:2", rdzv="c10d", rdzv_id="x", master="h:1", nproc="2", env={})
    with pytest.raises(ConfigError, match=r"node counts that keep it: 1 \(world 2\)"):
        check_node_range(cfg, plan)

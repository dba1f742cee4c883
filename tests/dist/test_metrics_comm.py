"""Communication share is measured for DDP (comm hook), FSDP2 (its own collectives, timed) and HSDP (its replicate
all-reduce too)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import TINY, events, run_script, train_in
from tests.world import World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]


@pytest.mark.parametrize(
    "strategy", [["dist.strategy=ddp"], ["dist.strategy=fsdp"], ["dist.strategy=hsdp", "dist.shard_size=1"]],
    ids=["ddp", "fsdp", "hsdp"],
)
def test_comm_share_is_measured(world: World, tmp_path: Path, strategy: list[str]) -> None:
    train_in(
        world, TINY, f"output_dir={tmp_path}", *strategy, "train.max_steps=6", "log.every_steps=2",
        "eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false", "log.tensorboard=false",
    )
    train = events(tmp_path / "tiny", "train")
    assert [e["step"] for e in train] == [2, 4, 6]
    for event in train:
        assert 0 < event["comm_share"] < 1, event
        assert event["mfu"] is None  # no peak is known for a CPU


def test_fsdp2_comm_counts_trained_steps_only(world: World, tmp_path: Path) -> None:
    out = tmp_path / "seconds.json"
    run_script(world, "time_fsdp_collectives", str(out))
    seconds = json.loads(out.read_text())
    assert seconds["trained"] > 0  # the all-gathers and reduce-scatters of a training step
    assert seconds["skipped"] == 0.0  # a step dropped for a non-finite loss
    assert seconds["evaluated"] == 0.0  # an evaluation's all-gathers are not training time


@pytest.mark.parametrize(("nproc", "shard_size"), [(2, 1), (4, 2)], ids=["hsdp-2x1", "hsdp-2x2"])
def test_hsdp_comm_includes_the_replicate_all_reduce(
    worlds: Callable[[int], World], tmp_path: Path, nproc: int, shard_size: int
) -> None:
    out = tmp_path / "seconds.json"
    run_script(worlds(nproc), "time_hsdp_all_reduce", str(out), str(shard_size))
    seconds = json.loads(out.read_text())
    assert seconds["seconds"] >= seconds["all_reduce_delay"], seconds  # each unit's all-reduce, slowed, was timed

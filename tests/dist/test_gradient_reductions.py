"""Accumulation keeps gradients sharded: FSDP2/HSDP reduce-scatter every micro-batch (HSDP all-reduces
across replicas once per step) unless `dist.defer_grad_sync` holds them to the window's last one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import TINY, run_script, trainyard
from tests.world import World

pytestmark = pytest.mark.dist

STEPS = 3
ACCUMULATION = 2


def gradient_reductions(
    tmp_path: Path, nproc: int, *overrides: str, world: World
) -> tuple[int, dict[int, dict[str, int]]]:
    """(FSDP units with trainable parameters, per step: FSDP2's reduce-scatters and all-reduces), on a shared world
    of `nproc` ranks."""
    out = tmp_path / "reductions.json"
    global_batch = 4 * ACCUMULATION * nproc
    argv = [str(tmp_path), str(out), f"train.max_steps={STEPS}", "train.micro_batch_size=4",
            f"train.global_batch_size={global_batch}", "lora.enabled=false", *overrides]
    assert world.nproc == nproc
    run_script(world, "count_gradient_reductions", *argv)
    found = json.loads(out.read_text())
    assert found["accumulation"] == ACCUMULATION
    assert found["units"] == 3  # two decoder blocks and the root (embeddings, norm)
    return found["units"], {int(step): calls for step, calls in found["per_step"].items()}


@pytest.mark.parametrize(("defer", "reduce_scatters_per_unit"), [("false", ACCUMULATION), ("true", 1)])
def test_fsdp_reduce_scatters_every_micro_batch_unless_deferred(
    world: World, tmp_path: Path, defer: str, reduce_scatters_per_unit: int
) -> None:
    units, per_step = gradient_reductions(
        tmp_path, 2, "dist.strategy=fsdp", f"dist.defer_grad_sync={defer}", world=world
    )
    assert sorted(per_step) == list(range(1, STEPS + 1))
    for calls in per_step.values():
        assert calls == {"reduce_scatter": reduce_scatters_per_unit * units}


@pytest.mark.parametrize(("defer", "reduce_scatters_per_unit"), [("false", ACCUMULATION), ("true", 1)])
def test_hsdp_reduce_scatters_every_micro_batch_and_all_reduces_once_per_step(
    worlds: Callable[[int], World], tmp_path: Path, defer: str, reduce_scatters_per_unit: int
) -> None:
    """4 ranks as 2 replicas x 2 shards: the all-reduce between replicas (the one that crosses the
    link between nodes) is one per unit per step either way."""
    units, per_step = gradient_reductions(
        tmp_path, 4, "dist.strategy=hsdp", "dist.shard_size=2", f"dist.defer_grad_sync={defer}", world=worlds(4)
    )
    assert sorted(per_step) == list(range(1, STEPS + 1))
    for calls in per_step.values():
        assert calls == {"reduce_scatter": reduce_scatters_per_unit * units, "all_reduce": units}


def test_a_shard_size_that_does_not_divide_the_world_exits_2_naming_it(tmp_path: Path) -> None:
    result = trainyard(
        "train", TINY, f"output_dir={tmp_path}", "train.max_steps=1", "dist.strategy=hsdp", "dist.shard_size=3",
        "--nproc", "2",
    )
    assert result.returncode == 2, result.stderr[-4000:]
    assert "dist.shard_size 3 does not divide the world size 2" in result.stderr
    assert "Traceback" not in result.stderr

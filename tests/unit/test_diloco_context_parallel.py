"""Context parallelism inside DiLoCo sites, without a world: the ranks of a CP group read the same rows, in one world
and in a fault-tolerant site (a world of its own reading its slice of every site's); the estimate and the dry run
count a rank's activations as CP without DiLoCo does (tokens / N of each micro-batch). The sites themselves train in
tests/dist/test_diloco_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO, TINY, run_cli
from trainyard import estimate
from trainyard.config_file import load_config
from trainyard.diloco.ft import data_slice
from trainyard.dist import DistInfo

CP = ["dist.context_parallel=2", "data.padding_free=true", "model.attn_implementation=varlen"]
SITES = ["dist.strategy=diloco", "diloco.groups=2", "diloco.inner=hsdp", "dist.shard_size=2"]


def rank(index: int, world: int) -> DistInfo:
    return DistInfo(index, world, index, world, torch.device("cpu"), "gloo")


def test_a_cp_group_reads_one_data_ranks_rows_in_one_world_and_in_a_fault_tolerant_site() -> None:
    one_world = load_config(TINY, [*SITES, *CP])
    assert [data_slice(one_world, rank(r, 4)) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # site 1 of 2, each a world of 4 at CP 2: the second site's 2 data ranks of 4 in one world of both sites
    site = load_config(TINY, [*SITES, *CP, "diloco.fault_tolerant=true", "diloco.site=1", "diloco.sites=2"])
    assert [data_slice(site, rank(r, 4)) for r in range(4)] == [(2, 4), (2, 4), (3, 4), (3, 4)]


LLAMA_1B = str(REPO / "configs" / "llama-1b.yaml")
H100_8 = estimate.Hardware("h100-80gb", 8, 1)
LONG = ["data.max_length=32768", "data.packing=false", "train.micro_batch_size=1", "train.global_batch_size=8",
        "dist.shard_size=4"]


def planned(*overrides: str) -> estimate.Estimate:
    return estimate.estimate(load_config(LLAMA_1B, [*LONG, *overrides]), H100_8, suggest=False)


def test_the_estimate_counts_a_sites_cp_rank_as_cp_without_diloco() -> None:
    """2 sites of 4 (hsdp shard 4 within a site) at CP 4 hold what hsdp shard 4 x 2 replicas at CP 4 holds: the same
    shard, a quarter of every micro-batch's tokens, the same exchange buffers."""
    diloco = ["dist.strategy=diloco", "diloco.groups=2", "diloco.inner=hsdp"]
    sites, hsdp = planned(*diloco, "dist.context_parallel=4"), planned("dist.strategy=hsdp", "dist.context_parallel=4")
    alone = planned(*diloco, "dist.context_parallel=1")
    assert sites.layout.context_parallel == hsdp.layout.context_parallel == 4
    assert sites.memory.activations == hsdp.memory.activations > 0
    assert sites.memory.logits == hsdp.memory.logits
    assert sites.memory.context_exchange == hsdp.memory.context_exchange > 0
    assert sites.memory.activations == pytest.approx(alone.memory.activations / 4, rel=1e-6)


def test_the_dry_run_plans_cp_inside_diloco_sites() -> None:
    result = run_cli("train", TINY, *SITES, *CP, "--dry-run", "--world-size", "4")
    assert result.returncode == 0, result.stderr[-2000:]
    flat = " ".join(result.stdout.split())
    assert "2 data ranks (context-parallel groups of 2 ranks)" in flat, flat
    assert "2 sites x 2 ranks (hsdp: replicate 1 x shard 2 within a site)" in flat, flat
    assert "context parallel 2: each rank holds 1/2 of every row's tokens" in flat, flat
    # the first step's largest micro-batch, and each CP rank's share of it (its row padded to a multiple of 2)
    first = flat.split("every rank's largest micro-batch: ", 1)[1]
    tokens = int(first.split(" tokens", 1)[0].replace(",", ""))
    assert f"each rank of a context-parallel group {-(-tokens // 2):,} of them" in first, first

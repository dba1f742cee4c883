"""HSDP's shape (replicas x shard group) and when `auto` picks it, without a process group."""

from __future__ import annotations

import pytest
import torch

import trainyard.plan as plan
from trainyard.config_file import load_config
from trainyard.dist import DistInfo, hsdp_shape
from trainyard.errors import ConfigError
from trainyard.plan import choose_strategy, replicated_state_bytes


def _info(world: int, per_node: int) -> DistInfo:
    return DistInfo(0, world, 0, per_node, torch.device("cpu"), None)


def test_hsdp_shards_within_a_node_and_replicates_across_nodes_by_default() -> None:
    assert hsdp_shape(_info(16, 8), None) == (2, 8)
    assert hsdp_shape(_info(4, 2), None) == (2, 2)


def test_shard_size_overrides_the_node() -> None:
    assert hsdp_shape(_info(16, 8), 4) == (4, 4)
    assert hsdp_shape(_info(2, 2), 1) == (2, 1)
    assert hsdp_shape(_info(16, 8), 16) == (1, 16)


def test_a_shard_size_that_does_not_divide_the_world_names_the_field_and_the_divisors() -> None:
    with pytest.raises(ConfigError) as raised:
        hsdp_shape(_info(4, 2), 3)
    assert "dist.shard_size 3 does not divide the world size 4" in str(raised.value)
    assert "1, 2, 4" in str(raised.value)
    with pytest.raises(ConfigError, match="defaults to the processes per node"):
        hsdp_shape(_info(4, 3), None)


def test_shard_size_with_a_strategy_without_shard_groups_is_refused() -> None:
    with pytest.raises(ConfigError, match="dist.shard_size is set but dist.strategy is fsdp"):
        load_config("tiny", ["dist.strategy=fsdp", "dist.shard_size=2"])
    assert load_config("tiny", ["dist.strategy=hsdp", "dist.shard_size=2"]).dist.shard_size == 2


def test_auto_picks_hsdp_on_several_nodes_when_a_node_can_hold_the_sharded_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = torch.nn.Linear(100, 100, bias=False)
    state = replicated_state_bytes(model)
    # Half a device holds a quarter of the state: too small for DDP, enough for 4 shards.
    monkeypatch.setattr(plan, "device_memory_bytes", lambda info: state // 2)
    assert choose_strategy("auto", model, _info(8, 4)) == "hsdp"
    assert choose_strategy("auto", model, _info(4, 4)) == "fsdp"  # one node: nothing to replicate across
    assert choose_strategy("auto", model, _info(8, 2)) == "fsdp"  # half the state per device: shard over all
    monkeypatch.setattr(plan, "device_memory_bytes", lambda info: 2 * state)
    assert choose_strategy("auto", model, _info(8, 4)) == "ddp"

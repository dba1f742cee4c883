"""A lite save copies the LoRA adapter to rank 0's host alone: every other rank's host keeps only its shard
(seed 000's GLM-4.5-Air adapter was 7.3 GB a rank), and rank 0's copy equals the unsharded adapter."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_script
from tests.world import World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]


@pytest.fixture(scope="module")
def reports(world: World, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What `adapter_state` held on each of 2 FSDP2 ranks of the tiny LoRA job."""
    out = tmp_path_factory.mktemp("adapter-gather")
    run_script(world, "adapter_state_two_ranks", str(out))
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

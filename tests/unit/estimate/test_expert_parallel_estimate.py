"""The estimate under dist.expert_parallel: each rank holds experts / N whole experts that FSDP2 no longer gathers,
the all-to-all's bytes per step (tokens x top_k x hidden x dtype, dispatch and combine, forward and backward, per MoE
layer) counted on the link they cross, and `auto`'s choice: seed 000's GLM-4.5-Air (from the known table, nothing
downloaded) on 2 x 8 H200 takes EP 8; tiny-moe on 2 CPU ranks and dense models stay at 1."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO, TINY, TINY_MOE
from trainyard import estimate, plan
from trainyard.config_file import load_config
from trainyard.dist import DistInfo
from trainyard.errors import ConfigError

SEED_000 = str(REPO / "configs" / "glm45air-fsdp-lora.yaml")
H200_2X8 = estimate.Hardware("h200", 8, 2)
ACCUM, TOKENS, TOP_K, HIDDEN, MOE_LAYERS, BF16 = 4, 4096, 8, 4096, 45, 2  # the seed job and GLM-4.5-Air's shape


@pytest.fixture(scope="module")
def glm() -> estimate.mem.Model:
    return estimate.mem.model_of(load_config(SEED_000))


@pytest.fixture(scope="module")
def seed(glm: estimate.mem.Model) -> dict[str, estimate.Estimate]:
    """Seed 000 under HSDP (shard group 8) without EP, with EP 8, with EP 4 (experts sharded again over 2)."""
    return {
        str(ep): estimate.estimate(load_config(SEED_000, [f"dist.expert_parallel={ep}"]), H200_2X8, model=glm)
        for ep in (1, 8, 4)
    }


def test_each_rank_holds_its_experts_whole_and_fsdp_no_longer_gathers_them(seed: dict, glm) -> None:
    plain, ep = seed["1"], seed["8"]
    experts = glm.counts.experts
    assert ep.layout.expert_parallel == 8 and plain.layout.expert_parallel == 1
    assert ep.memory.weights == plain.memory.weights  # 16 of 128 experts whole = the shard group's eighth
    # the current and the prefetched block no longer gather their 128 experts (bf16), nor their adapters' gradient
    assert plain.memory.fsdp_buffers - ep.memory.fsdp_buffers == pytest.approx(
        2 * experts.block_total * BF16 + experts.block_trainable * (BF16 + 4))
    assert ep.memory.expert_exchange == 2 * TOKENS * TOP_K * HIDDEN * BF16 and plain.memory.expert_exchange == 0
    assert ep.memory.peak < plain.memory.peak - 8 * 2**30
    assert any("16 of the 128 routed experts" in note for note in ep.memory.notes)


def test_the_all_to_all_bytes_per_step_replace_the_expert_gathers_on_nvlink(seed: dict, glm) -> None:
    plain, ep, four = seed["1"].timing, seed["8"].timing, seed["4"].timing
    experts = glm.counts.experts
    expert_bytes = (experts.total - experts.trainable) * BF16 + experts.trainable * BF16  # gathered in bf16
    assert plain.expert_gathered_bytes == pytest.approx(ACCUM * 2 * expert_bytes * 7 / 8)
    assert plain.expert_exchanged_bytes == 0 and ep.expert_gathered_bytes == 0
    # dispatch + combine, forward + backward + the checkpointed forward again, 7/8 of the rows leave the rank
    assert ep.expert_exchanged_bytes == pytest.approx(ACCUM * 6 * MOE_LAYERS * TOKENS * TOP_K * HIDDEN * BF16 * 7 / 8)
    assert ep.expert_exchange_link == "within a node"
    assert four.expert_gathered_bytes == pytest.approx(ACCUM * 2 * expert_bytes / 4 * 1 / 2)  # over the 2 left
    # and the adapters' fp32 gradients of the experts are reduce-scattered over no rank but themselves
    saved = plain.expert_gathered_bytes - ep.expert_exchanged_bytes + ACCUM * experts.trainable * 4 * 7 / 8
    assert plain.within_node_bytes - ep.within_node_bytes == pytest.approx(saved, rel=1e-3)
    assert ep.across_nodes_bytes == plain.across_nodes_bytes  # only the adapters' gradient crosses nodes
    assert ep.comm_s < plain.comm_s


def test_the_report_shows_the_experts_and_the_traffic_per_link(seed: dict) -> None:
    text = estimate.render(seed["8"])
    assert "expert parallel 8" in text and "ep all-to-all" in text
    assert "GB per GPU over NVLink" in text and "GB per node over the network" in text
    assert "all-to-all 254 GB per GPU (within a node)" in text
    assert estimate.to_json(seed["8"])["expert_parallel"] == 8


def test_auto_takes_the_largest_size_within_a_node_where_the_all_to_all_pays(glm) -> None:
    result = estimate.estimate(load_config(SEED_000, ["dist.expert_parallel=auto"]), H200_2X8, model=glm)
    assert result.layout.expert_parallel == 8
    assert "FSDP2 gathers 1.42e+03 GB of experts" in result.layout.expert_parallel_why
    # tiny-moe's 4 small experts: gathering them costs less than sending 768 tokens' rows to them
    tiny = estimate.estimate(load_config(TINY_MOE, ["dist.expert_parallel=auto"]), estimate.Hardware("cpu", 2))
    assert tiny.layout.expert_parallel == 1 and "fewer than EP 2's" in tiny.layout.expert_parallel_why
    dense = estimate.estimate(load_config(TINY, ["dist.strategy=fsdp", "dist.expert_parallel=auto"]),
                              estimate.Hardware("cpu", 2))
    assert dense.layout.expert_parallel == 1 and "dense" in dense.layout.expert_parallel_why


def test_the_plan_decides_auto_and_says_why() -> None:
    text = plan.describe_plan(load_config(SEED_000, ["dist.expert_parallel=auto"]), 16, plan.Target("h200", 8, 2))
    assert "expert parallel 8: each rank holds 16 of the 128" in text and "requested auto: FSDP2 gathers" in text
    cpu_pair = DistInfo(0, 2, 0, 2, torch.device("cpu"), None)
    size, why = plan.expert_parallel_size(load_config(TINY_MOE, ["dist.expert_parallel=auto"]), cpu_pair, "fsdp")
    assert size == 1 and "fewer than EP 2's" in why
    assert plan.expert_parallel_size(load_config(TINY_MOE, ["dist.expert_parallel=auto"]), cpu_pair, "ddp")[0] == 1
    assert plan.expert_parallel_size(load_config(TINY_MOE, ["dist.expert_parallel=2"]), cpu_pair, "fsdp") == (2, "")


def test_expert_parallel_takes_a_size_or_auto() -> None:
    assert load_config(TINY_MOE, ["dist.strategy=ddp", "dist.expert_parallel=auto"]).dist.expert_parallel == "auto"
    with pytest.raises(ConfigError, match="dist.expert_parallel"):
        load_config(TINY_MOE, ["dist.expert_parallel=0"])

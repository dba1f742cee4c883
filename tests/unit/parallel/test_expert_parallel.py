"""dist.expert_parallel is refused, exit 2 naming the field, where it cannot run exactly: without fsdp/hsdp, on a
model without routed experts or of a family not proven, at a size that does not divide the experts and the shard
dimension, or whose EP ranks' experts do not split evenly over the ranks left of it; a checkpoint written at one EP
size resumes only at that size."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import TINY, TINY_MOE, run_cli
from tests.unit.model.families import build
from trainyard.checkpoint.layout import check_compatible
from trainyard.config_file import load_config
from trainyard.errors import CheckpointError, ConfigError
from trainyard.parallel import expert_parallel

WHERE = "dist.expert_parallel (job.yaml:9)"


def refusal(model, ep: int, strategy: str = "fsdp", shard: int = 4) -> str:
    with pytest.raises(ConfigError) as err:
        expert_parallel.check(model, ep, strategy, shard, WHERE)
    assert err.value.where == WHERE
    return err.value.what + " " + (err.value.fix or "")


def test_expert_parallel_needs_fsdp_or_hsdp_and_exits_2_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="dist.expert_parallel 2 needs dist.strategy fsdp or hsdp"):
        load_config(TINY, ["dist.strategy=ddp", "dist.expert_parallel=2"])
    assert load_config(TINY, ["dist.strategy=hsdp", "dist.expert_parallel=2"]).dist.expert_parallel == 2
    result = run_cli("train", TINY_MOE, "dist.strategy=ddp", "dist.expert_parallel=2", "--dry-run")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "dist.expert_parallel" in result.stderr


def test_a_model_without_routed_experts_or_of_another_family_is_refused() -> None:
    assert "has no routed experts" in refusal(build("llama", "eager"), 2)
    config = AutoConfig.for_model("olmoe", vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    olmoe = AutoModelForCausalLM.from_config(config)
    assert expert_parallel.find_expert_stacks(olmoe), "olmoe has fused experts: the refusal is about the family"
    assert "not proven exact for olmoe" in refusal(olmoe, 2)


def test_the_size_must_divide_the_experts_and_the_shard_dimension() -> None:
    model = build("qwen3_moe", "eager")  # 4 experts
    assert "must divide the number of experts (4) and the shard dimension (6 ranks)" in refusal(model, 3, shard=6)
    assert "one of 1, 2" in refusal(model, 4, shard=6)
    assert "needs dist.strategy fsdp or hsdp" in refusal(model, 2, strategy="ddp")
    assert "2 experts do not split evenly over the 4 ranks" in refusal(model, 2, shard=8)
    expert_parallel.check(model, 2, "hsdp", 4, WHERE)
    expert_parallel.check(model, 4, "fsdp", 4, WHERE)


def test_the_dry_run_says_what_each_rank_holds_and_refuses_a_size_that_does_not_divide() -> None:
    result = run_cli("train", TINY_MOE, "dist.expert_parallel=2", "--dry-run", "--world-size", "4")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "expert parallel 2: each rank holds 2 of the 4 routed experts of each MoE layer" in result.stdout
    assert "sharded further over 2 ranks" in result.stdout
    refused = run_cli("train", TINY_MOE, "dist.expert_parallel=3", "--dry-run", "--world-size", "6")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "dist.expert_parallel 3 must divide the number of experts (4)" in " ".join(refused.stderr.split())


def test_a_checkpoint_resumes_only_at_its_expert_parallel_size(tmp_path: Path) -> None:
    facts = {"model_signature": "a", "lora": None, "data_fingerprint": "d", "global_batch_samples": 16}
    check_compatible({**facts, "expert_parallel": 2}, {**facts, "expert_parallel": 2}, tmp_path)
    check_compatible(facts, {**facts, "expert_parallel": None}, tmp_path)  # written before EP existed
    with pytest.raises(CheckpointError, match="expert_parallel: checkpoint has 2, this job has None"):
        check_compatible({**facts, "expert_parallel": 2}, {**facts, "expert_parallel": None}, tmp_path)

"""dist.expert_parallel is refused, exit 2 naming the field, where it cannot run exactly: without fsdp/hsdp, on a
model without routed experts or of a family not proven, at a size that does not divide the experts and the shard
dimension, or whose EP ranks' experts do not split evenly over the ranks left of it. Checkpoints lay the expert
adapters out alike at every EP size, so that a resume may change it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import TINY, TINY_MOE, run_cli
from tests.unit.model.families import build
from trainyard.checkpoint.layout import check_compatible
from trainyard.config_file import load_config
from trainyard.errors import ConfigError
from trainyard.estimate import arch as estimate_arch
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


def test_without_ep_a_checkpoint_sees_the_expert_adapters_as_ep_writes_them(tmp_path: Path) -> None:
    """A checkpoint at any EP size holds an expert lora_B as [out, r, experts] (its memory, so a load fills it), the
    dense adapters and the base as they are; the EP size is no fact a resume must match; a checkpoint in PEFT's
    [out, r x experts] (written before) is read in its own layout."""
    facts = {"model_signature": "a", "lora": None, "data_fingerprint": "d", "global_batch_samples": 16}
    check_compatible({**facts, "expert_parallel": 2}, {**facts, "expert_parallel": None}, tmp_path)
    cfg = load_config(TINY_MOE)
    model = estimate_arch.meta_model(cfg, estimate_arch.hf_config(cfg))
    model.to_empty(device="cpu")
    for param in model.parameters():
        param.data.normal_()
    names = expert_parallel.expert_adapter_names(model)
    assert len(names) == 4 and set(names.values()) == {4}  # 2 MoE layers x (gate_up_proj, down_proj)
    state = {"model": dict(model.named_parameters())}
    seen = expert_parallel.whole_stacks(model, state)["model"]
    for name, param in state["model"].items():
        if name in names:
            assert seen[name].shape == (param.shape[0], param.shape[1] // 4, 4)
            assert seen[name].data_ptr() == param.data_ptr()
            assert torch.equal(seen[name][:, 1, 3], param[:, 1 * 4 + 3])  # expert innermost, as PEFT lays it out
        else:
            assert seen[name] is param
    assert expert_parallel.whole_stacks(model, state, experts_apart=False) is state
    entry = next(iter(names))

    def saved(key: str, *size: int) -> dict:
        return {key: TensorStorageMetadata(None, torch.Size(size), [])}

    assert expert_parallel.saved_apart(model, saved(f"model.{entry}", 8, 8, 4))
    assert not expert_parallel.saved_apart(model, saved(f"site-0.model.{entry}", 8, 32))

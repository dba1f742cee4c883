"""model.quantize nf4: the frozen base in 4-bit NF4 under LoRA; where it cannot apply, the job is refused."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from tests.conftest import TINY, run_cli
from trainyard.errors import ModelError
from trainyard.model import quantize, weights


def test_nf4_without_lora_is_refused_naming_the_field_and_the_fix() -> None:
    done = run_cli("train", TINY, "model.quantize=nf4", "lora.enabled=false")
    assert done.returncode == 2, done.stderr
    assert "model.quantize" in done.stderr and "set lora.enabled: true" in done.stderr
    assert "Traceback" not in done.stderr


def test_nf4_with_peft_s_expert_fold_is_refused() -> None:
    done = run_cli("train", TINY, "model.quantize=nf4", "lora.enabled=true", "lora.moe_adapter=peft")
    assert done.returncode == 2, done.stderr
    assert "lora.moe_adapter" in done.stderr and "set lora.moe_adapter: grouped" in done.stderr


def test_nf4_with_frozen_weights_in_checkpoints_is_refused() -> None:
    done = run_cli("train", TINY, "model.quantize=nf4", "lora.enabled=true", "checkpoint.save_frozen=true")
    assert done.returncode == 2, done.stderr
    assert "checkpoint.save_frozen" in done.stderr and "set checkpoint.save_frozen: false" in done.stderr


def _meta_llama(hidden: int) -> torch.nn.Module:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def test_nf4_takes_the_linear_weights_whose_size_divides_and_never_the_head_or_embeddings() -> None:
    quantized, left = quantize.nf4_targets(_meta_llama(128), torch.float32)
    assert sorted(name.split(".")[-2] for name in quantized) == sorted(
        ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert sorted(name.split(".")[-2] for name in left) == ["k_proj", "v_proj"]  # 64 x 128 values: half a unit
    assert not any("embed" in name or "lm_head" in name or "norm" in name for name in quantized + left)


def test_each_rank_s_rows_are_the_whole_tensor_quantized_then_split() -> None:
    """NF4's scales share one mean over the tensor: rows quantized alone would dequantize to other values."""
    nf4 = quantize.nf4_module()
    whole = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    expected = nf4.to_nf4(whole).get_original_weight()
    meta = quantize._meta_nf4(nf4, whole.shape, whole.dtype, torch.device("cpu"))
    for start, stop in ((0, 128), (0, 64), (64, 128)):
        local = torch.empty_like(meta.split(stop - start)[0], device="cpu")
        quantize.fill_own_rows(local, whole, start, stop)
        assert isinstance(local, nf4.NF4Tensor)
        assert torch.equal(local.get_original_weight(), expected[start:stop])


def test_a_weight_that_shards_do_not_split_into_whole_blocks_is_refused_naming_it() -> None:
    model = _meta_llama(256)
    quantized, _ = quantize.nf4_targets(model, torch.float32)
    with pytest.raises(ModelError, match=r"q_proj.weight \(256, 256\) cannot be split into 8 shards"):
        quantize.quantize_meta(model, set(quantized), 8, torch.device("cpu"), weights.checkpoint_key)
    done = quantize.quantize_meta(model, set(quantized), 2, torch.device("cpu"), weights.checkpoint_key)
    assert done == len(quantized)
    assert quantize.is_nf4(model.model.layers[0].mlp.down_proj.weight)


def test_fused_expert_stacks_stay_in_the_model_s_dtype_and_the_log_says_so() -> None:
    config = AutoConfig.for_model("glm4_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                  num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
                                  num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=300)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    quantized, left = quantize.nf4_targets(model, torch.float32)
    assert "model.layers.1.mlp.experts.gate_up_proj" in left and "model.layers.1.mlp.experts.down_proj" in left
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in quantized
    assert not any(".gate." in name or name.endswith("gate.weight") for name in quantized)  # the router
    assert "or fused experts" in quantize.describe(quantized, left)

"""The estimate's low-bit weights: model.quantize nf4 counts torchao's NF4 layout byte for byte (codes, scales and
their scales), gathers 4-bit blocks under FSDP2, and is the cheapest fix where it is what makes a LoRA job fit;
train.precision fp8 gathers in FP8 under tensorwise scales and names the linears that stay bf16. The seed jobs:
GLM-4.5-Air on one node of 8 H200 and Mistral-7B LoRA on one 24 GB GPU, both with nf4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TINY, TINY_MOE, run_cli
from tests.unit.test_plan_dry_run import dry_run, llama_8b
from trainyard import dist, estimate, precision
from trainyard.config_file import load_config
from trainyard.estimate import quantized
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import source as source_room
from trainyard.train.build import build_and_wrap

MISTRAL = str(REPO / "configs" / "mistral7b-lora-ddp.yaml")
GLM = str(REPO / "configs" / "glm45air-fsdp-lora.yaml")
# hidden 128: q/o/gate/up/down hold whole scaler blocks of 256; k/v (64 x 128: 128 blocks) take scaler blocks of 128
WIDE = ["model.config.hidden_size=128", "model.config.intermediate_size=256", "lora.enabled=true",
        "model.dtype=bfloat16"]
LONG_ROWS = ["data.max_length=16384", "train.micro_batch_size=1", "train.global_batch_size=16"]
CPU = torch.device("cpu")


def nf4(tensor: torch.Tensor) -> torch.Tensor:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    blocks = tensor.numel() // quantized.NF4_BLOCK
    return to_nf4(tensor, quantized.NF4_BLOCK, blocks // quantized.scaler_blocks(tensor.numel()))


def held_bytes(tensor: torch.Tensor) -> int:
    """Every byte an NF4Tensor holds (its inner tensors), or a plain tensor's."""
    if type(tensor).__name__ != "NF4Tensor":
        return tensor.nbytes
    return sum(getattr(tensor, name).nbytes for name in
               ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"))


def test_nf4_bytes_are_torchaos_layout_exactly() -> None:
    for shape, dtype in [((256, 128), torch.bfloat16), ((1024, 48), torch.float32), ((576, 576), torch.bfloat16),
                         ((3, 64), torch.float32)]:  # scaler blocks of 256, 256, 64 and 1
        weight = torch.randn(shape, dtype=dtype)
        size = weight.element_size()
        held = held_bytes(nf4(weight))
        assert quantized.nf4_bytes(weight.numel(), quantized.scaler_blocks(weight.numel()), 1, size) == held
    assert quantized.nf4_bytes(4096 * 4096, 4096 * 4096 / 16384, 1, 2) / (4096 * 4096) == pytest.approx(
        0.5 + 1 / 64 + 2 / 16384, abs=1e-5)


def test_lora_weights_are_the_real_nf4_models_bytes() -> None:
    """The tiny Llama at hidden 128 with LoRA, its quantizable frozen weights put through torchao: the estimate's
    weights on one device are the bytes the model then holds outside its adapters."""
    cfg = load_config(TINY, [*WIDE, "model.quantize=nf4"])
    model = model_room.load_model(cfg.model, None, source_room.load_tokenizer(cfg.model, None), torch.bfloat16, 0)
    model = lora_room.apply_lora(model, cfg.lora, 0)
    head = model.get_output_embeddings()
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not head and not module.weight.requires_grad:
            if module.weight.numel() % quantized.NF4_BLOCK == 0:
                module.weight = torch.nn.Parameter(nf4(module.weight.detach()), requires_grad=False)
    held = sum(held_bytes(p) for p in model.parameters() if not p.requires_grad)
    result = estimate.estimate(cfg, estimate.Hardware("h100-80gb"))
    assert result.memory.weights == pytest.approx(held, rel=1e-9)
    plain = estimate.estimate(load_config(TINY, WIDE), estimate.Hardware("h100-80gb"))
    assert result.memory.weights < 0.6 * plain.memory.weights  # embeddings and norms stay bf16


def test_moe_expert_stacks_count_the_bytes_of_their_per_expert_nf4_weights() -> None:
    """The tiny MoE built as training builds it (each routed expert its own NF4Tensor): what nf4 takes off the
    frozen weights is what the estimate takes off, byte for byte, most of it the experts'."""
    def frozen_and_estimated(quantize: str) -> tuple[int, float]:
        cfg = load_config(TINY_MOE, [f"model.quantize={quantize}", "model.dtype=bfloat16", "dist.strategy=none"])
        tokenizer = source_room.load_tokenizer(cfg.model, None)
        model, _, _ = build_and_wrap(cfg, dist.DistInfo(0, 1, 0, 1, CPU, None), precision.resolve(cfg, CPU), None,
                                     tokenizer)
        held = sum(held_bytes(p) for p in model.parameters() if not p.requires_grad)
        return held, estimate.estimate(cfg, estimate.Hardware("h100-80gb")).memory.weights

    (plain, plain_estimate), (four, four_estimate) = frozen_and_estimated("none"), frozen_and_estimated("nf4")
    assert plain - four == pytest.approx(plain_estimate - four_estimate, abs=1e-6)
    experts = 2 * 4 * (96 * 64 + 64 * 48)  # two MoE layers of 4 experts: gate_up, down
    assert plain - four > 2 * experts * (2 - 0.54)


def test_under_fsdp_nf4_is_sharded_and_gathered_in_4_bits() -> None:
    hardware = estimate.Hardware("h100-80gb", 8)
    plain = estimate.estimate(load_config(MISTRAL, ["dist.strategy=fsdp"]), hardware)
    four = estimate.estimate(load_config(MISTRAL, ["dist.strategy=fsdp", "model.quantize=nf4"]), hardware)
    low = four.memory
    block = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336  # q, o; k, v (1,024 rows); the MLP
    assert low.fsdp_buffers == pytest.approx(
        plain.memory.fsdp_buffers - 2 * (2 * block - quantized.nf4_gathered_bytes(block, block / 16384, 2)))
    assert low.weights == pytest.approx(plain.memory.weights - (2 * 6.98e9 - 0.5158 * 6.98e9) / 8, rel=2e-3)
    assert four.timing.within_node_bytes < 0.35 * plain.timing.within_node_bytes  # gathers in 4 bits, not bf16
    assert any(note.startswith("nf4: 6.98B frozen weights in 4 bits") for note in low.notes)


def test_nf4_is_the_cheapest_fix_where_it_is_what_makes_a_lora_job_fit() -> None:
    """Mistral-7B LoRA on one 24 GB L4 with 16k-token rows: checkpointing is on and one row a micro-batch already,
    so nothing cheaper fits; never for full fine-tuning, which nf4 cannot train."""
    plain = estimate.estimate(load_config(MISTRAL, LONG_ROWS), estimate.Hardware("l4"))
    assert not plain.fits and plain.fix is not None and plain.fix.startswith("model.quantize=nf4 (peak 16.")
    fixed = estimate.estimate(load_config(MISTRAL, [*LONG_ROWS, "model.quantize=nf4"]), estimate.Hardware("l4"))
    assert fixed.fits and fixed.fix is None
    full = estimate.estimate(load_config(MISTRAL, ["lora.enabled=false"]), estimate.Hardware("h100-80gb", 8))
    assert full.fix is not None and "nf4" not in full.fix


def test_the_dry_run_says_nf4_is_what_makes_it_fit(tmp_path: Path) -> None:
    code, output = dry_run(f"output_dir={tmp_path}", "model.config=null", f"model.path={llama_8b(tmp_path)}",
                           "lora.enabled=true", "model.gradient_checkpointing=true", *LONG_ROWS,
                           "--gpu", "l4", "--gpus-per-node", "1", "--skip-data-check")
    assert code == 2 and "(does NOT fit)" in output
    assert "cheapest fix     model.quantize=nf4 (peak" in output


def test_the_seed_jobs_fit_with_nf4() -> None:
    """Seed 000 (GLM-4.5-Air, 108B) LoRA on one node of 8 H200 instead of two, and seed 002's Mistral-7B LoRA on one
    24 GB GPU, as `trainyard estimate` prints them. GLM's routed experts (most of its weights) are in 4 bits too,
    each expert its own NF4 weight."""
    glm = run_cli("estimate", GLM, "model.quantize=nf4", "--gpu", "h200", "--gpus-per-node", "8", "--json")
    assert glm.returncode == 0, glm.stderr
    mistral = run_cli("estimate", MISTRAL, "model.quantize=nf4", "--gpu", "l4", "--json")
    assert mistral.returncode == 0, mistral.stderr
    for result, most in ((json.loads(glm.stdout), 24 * 2**30), (json.loads(mistral.stdout), 12 * 2**30)):
        assert result["fits"] and result["peak_bytes_per_device"] < most
        assert any(note.startswith("nf4: ") for note in result["notes"])
    assert any(note.startswith("nf4: 106B frozen weights") for note in json.loads(glm.stdout)["notes"])
    # expert_parallel auto leaves each NF4 expert on 2 ranks or more (the build refuses one: nf4_experts)
    glm_layout = json.loads(glm.stdout)
    assert glm_layout["shard_group"] // glm_layout["expert_parallel"] >= 2, glm_layout["expert_parallel"]


def test_fp8_gathers_in_fp8_with_tensorwise_scales_and_names_what_stays_bf16() -> None:
    odd = ["model.config.intermediate_size=40", "dist.strategy=fsdp"]  # gate/up/down: 40 is no multiple of 16
    hardware = estimate.Hardware("h100-80gb", 2)
    mixed = estimate.estimate(load_config(TINY, [*odd, "train.precision=bf16-mixed"]), hardware)
    tensorwise = estimate.estimate(load_config(TINY, [*odd, "train.precision=fp8"]), hardware)
    rowwise = estimate.estimate(load_config(TINY, [*odd, "train.precision=fp8", "train.fp8_scaling=rowwise"]),
                                hardware)
    attention = 64 * 64 * 2 + 32 * 64 * 2  # q, o; k, v (2 kv heads of 16)
    assert tensorwise.precision == "fp8"
    assert tensorwise.memory.fsdp_buffers == pytest.approx(mixed.memory.fsdp_buffers - 2 * attention)
    assert rowwise.memory.fsdp_buffers == pytest.approx(mixed.memory.fsdp_buffers)
    model = estimate.mem.model_of(load_config(TINY, odd))
    assert sorted(name.rsplit(".", 1)[-1] for name in model.counts.low_bit.fp8_kept) == \
        sorted(["gate_proj", "up_proj", "down_proj"] * 2)
    assert any("3 stay bf16" not in note and "6 stay bf16" in note for note in tensorwise.memory.notes)


def test_the_estimate_counts_the_second_level_scales_the_quantization_makes() -> None:
    """SmolLM2-135M's 576 x 576 and 192 x 576 (scaler blocks of 8, so that 8 shards split them), its MLP's 1536 x
    576 (64) and 4096 x 4096 (256): the estimate's count of a weight's second-level scales is what NF4 stores."""
    from trainyard.model import nf4_fast

    for shape in [(576, 576), (192, 576), (1536, 576), (4096, 4096)]:
        weight = torch.zeros(shape, dtype=torch.bfloat16)
        assert quantized.scaler_blocks(weight.numel()) == nf4_fast.to_nf4(weight).quantization_factor.numel(), shape

"""LoRA reaches MoE experts stored as fused 3-D parameters, and the plan says how many carry adapters."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO
from trainyard.config_file import PRESETS, load_config, preset_path
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import source as source_room
from trainyard.plan import describe_plan

EXPERTS = "4 expert parameters (2 layers × mlp.experts.down_proj, mlp.experts.gate_up_proj)"


def lora_line(preset: str, *overrides: str) -> str:
    plan = describe_plan(load_config(preset, ["lora.enabled=true", *overrides]), world_size=2)
    return next(line for line in plan.splitlines() if line.startswith("lora "))


def test_plan_says_how_many_expert_parameters_carry_adapters() -> None:
    """all-linear: attention (3 layers × q, k, v, o) and, by PEFT's mapping of the experts' old names, the routed
    experts; the router only when target_modules names it (PEFT's all-linear would adapt it too)."""
    assert lora_line("tiny-moe").endswith(f"on 12 modules, {EXPERTS}")
    assert lora_line("tiny-moe", "lora.target_modules=[q_proj,gate]").endswith(
        f"on 3 modules, {EXPERTS}, 2 other parameters (mlp.gate.weight)"
    )


def test_auto_reaches_the_experts_when_target_modules_name_only_attention() -> None:
    assert lora_line("tiny-moe", "lora.target_modules=[q_proj,v_proj]").endswith(f"on 6 modules, {EXPERTS}")
    assert lora_line("tiny-moe", "lora.target_modules=[q_proj,v_proj]", "lora.target_parameters=[]").endswith(
        "on 6 modules"
    )


def test_a_dense_model_gets_no_parameter_adapters() -> None:
    assert lora_line("tiny").endswith("on 14 modules")


def test_gradients_reach_every_layers_expert_adapters() -> None:
    cfg = load_config("tiny-moe")
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    model = model_room.load_model(cfg.model, None, tokenizer, torch.float32, cfg.train.seed)
    model = lora_room.apply_lora(model, cfg.lora, cfg.train.seed)
    batch = tokenizer(["<|user|>2024-02-29<|assistant|>February 29, 2024"] * 4, return_tensors="pt")
    model(**batch, labels=batch["input_ids"]).loss.backward()
    expert_b = {name: p.grad for name, p in model.named_parameters() if ".mlp.experts." in name and "lora_B" in name}
    assert len(expert_b) == 4  # 2 MoE layers × (gate_up_proj, down_proj); lora_A's gradient is 0 while B is 0
    assert all(grad is not None and grad.abs().sum() > 0 for grad in expert_b.values()), expert_b


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_ships_as_the_config_of_the_same_name(name: str) -> None:
    assert preset_path(name).read_text() == (REPO / "configs" / f"{name}.yaml").read_text()

"""train.precision fp8 on CPU, with torchao's emulation (FP8-rounded operands, products in high precision): which
linears convert and which stay bf16 (named), that a converted model trains, that its state dict is plain tensors
under the unconverted keys, and that a device without FP8 units is refused with exit 2, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY, trainyard
from trainyard.config_file import load_config
from trainyard.errors import ConfigError
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import source as source_room
from trainyard.parallel import float8

ODD_MLP = "model.config.intermediate_size=40"  # gate/up out 40, down in 40: no FP8 kernel takes them


def tiny(*overrides: str) -> torch.nn.Module:
    """The tiny preset's Llama in fp32 (with LoRA where asked), the same seeded weights every call."""
    cfg = load_config(TINY, list(overrides))
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    model = model_room.load_model(cfg.model, None, tokenizer, torch.float32, cfg.train.seed)
    return lora_room.apply_lora(model, cfg.lora, cfg.train.seed) if cfg.lora.enabled else model


def batch() -> torch.Tensor:
    return torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))


def test_lora_base_layers_convert_adapters_head_and_odd_shapes_stay_and_are_named() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = tiny("lora.enabled=true", ODD_MLP)
    converted, kept = float8.convert(model, "tensorwise", all_gather=False, emulate=True)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"] * 2  # both layers' attention
    assert sorted(name.split(".")[-2] for name in converted) == sorted(attention)
    assert all(name.endswith("base_layer") for name in converted + kept)
    assert sorted(name.split(".")[-2] for name in kept) == sorted(["gate_proj", "up_proj", "down_proj"] * 2)
    for name, module in model.named_modules():
        assert isinstance(module, Float8Linear) == (name in converted), name
    adapters = [m for n, m in model.named_modules() if "lora_" in n and isinstance(m, torch.nn.Linear)]
    assert adapters and all(type(m) is torch.nn.Linear for m in adapters)
    assert type(model.get_output_embeddings()) is torch.nn.Linear


def test_a_converted_model_computes_in_fp8_and_trains_its_adapters() -> None:
    reference, model = tiny("lora.enabled=true"), tiny("lora.enabled=true")
    converted, kept = float8.convert(model, "tensorwise", all_gather=False, emulate=True)
    assert len(converted) == 14 and not kept  # 7 linears in each of the 2 layers
    ids = batch()
    with torch.no_grad():
        exact = reference(input_ids=ids).logits
    logits = model(input_ids=ids).logits
    error = ((logits - exact).norm() / exact.norm()).item()
    assert 0 < error < 0.1  # FP8-rounded operands: near the fp32 products, not equal to them
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads) and any(g.abs().sum() > 0 for g in grads.values())


def test_rowwise_scales_one_per_row() -> None:
    from torchao.float8.config import ScalingGranularity

    model = tiny()
    converted, _ = float8.convert(model, "rowwise", all_gather=False, emulate=True)
    layer = model.get_submodule(converted[0])
    assert layer.config.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE
    model(input_ids=batch()).logits.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0  # full fine-tuning: weights learn


def test_the_state_dict_is_plain_tensors_under_the_unconverted_keys(tmp_path: Path) -> None:
    plain, model = tiny(), tiny()
    float8.convert(model, "tensorwise", all_gather=True, emulate=True)  # weights wrapped for FP8 all-gather
    state = model.state_dict()
    assert state.keys() == plain.state_dict().keys()
    assert all(type(value) is torch.Tensor for value in state.values())
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, tmp_path / "model.safetensors")
    other = tiny("train.seed=7")
    float8.convert(other, "tensorwise", all_gather=True, emulate=True)
    other.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())


def test_a_cpu_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="CPU, which has no FP8") as refused:
        float8.require_device(torch.device("cpu"), "train.precision")
    assert "train.precision: bf16-mixed" in refused.value.render()


def test_a_gpu_below_compute_capability_8_9_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: torch's answers for an A100 stand in for one."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert float8.refusal(torch.device("cuda", 0)) == ("NVIDIA A100-SXM4-80GB has compute capability 8.0; FP8 "
                                                      "products need 8.9 or more (L4, H100, H200)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert float8.refusal(torch.device("cuda", 0)) is None


def test_training_fp8_on_a_cpu_exits_2_naming_the_device(tmp_path: Path) -> None:
    done = trainyard("train", TINY, "train.precision=fp8", f"output_dir={tmp_path}", "train.max_steps=1")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "fp8: this process runs on CPU" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_fp8_with_an_nf4_base_is_refused() -> None:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from trainyard.precision import Precision

    model = tiny("lora.enabled=true", "model.config.hidden_size=128", "model.config.intermediate_size=256")
    layer = model.get_submodule(next(n for n in float8.fp8_linears(model)[0] if "gate_proj" in n))  # 256 x 128
    layer.weight = torch.nn.Parameter(to_nf4(layer.weight.detach()), requires_grad=False)
    fp8 = Precision("fp8", torch.float32, torch.bfloat16, torch.bfloat16, "train.precision", "tensorwise")
    with pytest.raises(ConfigError, match="fp8 with model.quantize nf4"):
        float8.apply(model, fp8, torch.device("cpu"), sharded=False, where="train.precision")

"""nf4_linear: an NF4 base's products dequantize in chunks to torchao's values, and compute what torchao's
linear_nf4 computes, forward and backward."""

from __future__ import annotations

import pytest
import torch

from trainyard.model import nf4_fast, nf4_linear


def _nf4(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * torch.rand(shape[0], 1, generator=generator) * 3
    return nf4_fast.to_nf4(values.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(576, 576), (256, 640), (64, 192)])
def test_the_chunked_dequantization_is_torchao_s_bit_for_bit(shape, dtype, monkeypatch) -> None:
    monkeypatch.setattr(nf4_linear, "CHUNK_BYTES", 4096)  # many chunks, one of them short
    weight = _nf4(shape, dtype)
    for target in (torch.bfloat16, torch.float32):
        reference = weight.to(target)
        mine = nf4_linear.dequantize(weight, target)
        assert mine.dtype == reference.dtype == target
        assert torch.equal(mine, reference)
    assert torch.equal(nf4_linear.dequantize(weight.t()), weight.get_original_weight().t())


def test_a_stack_of_experts_dequantizes_each_into_its_slice() -> None:
    experts = [_nf4((128, 64), torch.bfloat16, seed) for seed in range(3)]
    stack = nf4_linear.dequantize_stack(experts)
    assert stack.shape == (3, 128, 64)
    assert all(torch.equal(stack[index], weight.get_original_weight()) for index, weight in enumerate(experts))


@pytest.mark.parametrize("autocast", [False, True])
def test_the_linear_computes_torchao_s_product_and_input_gradient(autocast: bool) -> None:
    """NF4Linear against torchao's own F.linear on an NF4Tensor (linear_nf4), with a bias, under bf16 autocast."""
    weight = _nf4((320, 256), torch.bfloat16)
    bias = torch.randn(320)
    layer = torch.nn.Linear(256, 320)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias = torch.nn.Parameter(bias.clone())
    reference_layer = torch.nn.Linear(256, 320)
    reference_layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    reference_layer.bias = torch.nn.Parameter(bias.clone())
    layer.__class__ = nf4_linear.NF4Linear
    inputs = torch.randn(2, 7, 256, dtype=torch.float32 if autocast else torch.bfloat16)
    mine, theirs = inputs.clone().requires_grad_(), inputs.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, reference = layer(mine), reference_layer(theirs)
    assert out.dtype == reference.dtype
    assert torch.equal(out, reference)
    grad = torch.randn_like(out)
    out.backward(grad)
    reference.backward(grad)
    assert torch.equal(mine.grad, theirs.grad)
    assert torch.equal(layer.bias.grad, reference_layer.bias.grad)
    assert layer.weight.grad is None


def test_a_lora_over_an_nf4_linear_keeps_the_fused_adapter_product() -> None:
    from peft import LoraConfig, get_peft_model

    from trainyard.model.lora_linear import use_fused_linear_adapters

    model = torch.nn.Sequential(torch.nn.Linear(256, 320, bias=False))
    model[0].weight = torch.nn.Parameter(_nf4((320, 256), torch.bfloat16), requires_grad=False)
    model[0].__class__ = nf4_linear.NF4Linear
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["0"], lora_dropout=0.0))
    assert use_fused_linear_adapters(peft_model) == 1
    layer = peft_model.base_model.model[0]
    assert layer._plain_adapter() == "default"

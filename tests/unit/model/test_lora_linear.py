"""lora_linear.py: the adapter's update added inside its product computes PEFT's function, forward and backward, and
hands back to PEFT's own forward wherever the fused one would not be the same function."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from trainyard.model.lora_linear import FusedLoraLinear, use_fused_linear_adapters


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 24)
        self.down = torch.nn.Linear(24, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


def pair(**lora: object) -> tuple[torch.nn.Module, torch.nn.Module]:
    """PEFT's model and the same model with fused adapters, equal weights, B non-zero (PEFT starts it at 0)."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], **lora)  # type: ignore[arg-type]
    peft = get_peft_model(Block(), config)
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    fused = copy.deepcopy(peft)
    assert use_fused_linear_adapters(fused) == 2
    return peft, fused


def run(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_same_function_and_gradients_as_peft_in_fp32() -> None:
    peft, fused = pair()
    x = torch.randn(2, 5, 16)
    expected, expected_grads = run(peft, x)
    got, grads = run(fused, x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected_grads.keys() and len(grads) == 4
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert fused.state_dict().keys() == peft.state_dict().keys()


def test_under_bf16_autocast_it_stays_near_peft() -> None:
    peft, fused = pair()
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = peft(x), fused(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", ["merged", "disabled", "dora", "two adapters"])
def test_peft_forward_where_the_fused_one_would_differ(case: str) -> None:
    peft, fused = pair(use_dora=case == "dora")
    for model in (peft, fused):
        if case == "merged":
            model.merge_adapter()
        elif case == "two adapters":
            model.add_adapter("other", LoraConfig(r=2, target_modules=["up", "down"]))
            model.base_model.set_adapter(["default", "other"])
    modules = [m for m in fused.modules() if isinstance(m, FusedLoraLinear)]
    assert len(modules) == 2
    if case != "disabled":
        assert all(m._plain_adapter() is None for m in modules)
    x = torch.randn(2, 16)
    context = fused.disable_adapter() if case == "disabled" else None
    if context is None:
        torch.testing.assert_close(fused(x), peft(x), rtol=1e-6, atol=1e-6)
    else:
        with context, peft.disable_adapter():
            assert all(m._plain_adapter() is None for m in modules)
            torch.testing.assert_close(fused(x), peft(x), rtol=1e-6, atol=1e-6)


def test_under_autocast_the_adapter_reads_the_input_as_it_is_with_peft_s_cast_s_exact_result() -> None:
    """bf16-mixed as trainyard trains it (frozen base bf16, adapters fp32, bf16 autocast): PEFT casts the input to the
    adapter's fp32 and autocast casts it straight back, two copies of it each way. The fused forward skips that
    cast; outputs and every gradient, the input's included, are bit for bit those of the cast path (taken here
    through a zero dropout, which keeps PEFT's cast)."""
    _, fused = pair()
    for name, param in fused.named_parameters():
        if "lora_" not in name:
            param.data = param.data.to(torch.bfloat16)
    casting = copy.deepcopy(fused)
    for module in casting.modules():
        if isinstance(module, FusedLoraLinear):
            module.lora_dropout["default"] = torch.nn.Dropout(p=0.0)
    casts: list[torch.dtype] = []
    for module in fused.modules():
        if isinstance(module, FusedLoraLinear):
            module._cast_input_dtype = lambda x, dtype: casts.append(dtype) or x  # type: ignore[method-assign]
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    results = []
    for model in (fused, casting):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, grads = run(model, leaf)
        results.append((out, grads, leaf.grad))
    (got, grads, x_grad), (expected, expected_grads, expected_x_grad) = results
    assert casts == []
    assert torch.equal(got, expected) and torch.equal(x_grad, expected_x_grad)
    assert grads.keys() == expected_grads.keys() and len(grads) == 4
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name

"""Expert LoRA as grouped low-rank products gives PEFT's fold's loss and adapter gradients (fp32), on a tiny model of
every family transformers stores with fused 3-D experts; its adapter files are PEFT's; the router stays frozen.

Tolerance: in fp32 the two paths differ only in rounding order (x·(W + s·B·A) against x·W + s·(x·Aᵀ)·Bᵀ, and the
weight gradient summed per expert over its tokens rather than through the folded stack); measured relative
differences are ≤ 2.1e-7 for the loss and ≤ 4.0e-6 for the worst adapter gradient (norm of the difference over the
norm, 5 families). RTOL = 2e-5 leaves 5× room, and dropping the experts' adapters moves the loss and every expert
adapter gradient by more than 100× RTOL (asserted), so the comparison can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit.model.families import build, documents
from trainyard.config import LoraConfig
from trainyard.model.lora import apply_lora
from trainyard.model import moe_lora
from trainyard.model.moe_lora import GroupedExpertsLora

RTOL = 2e-5
FUSED = ["glm4_moe", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]


def adapted(family: str, moe_adapter: str, **changes: object) -> torch.nn.Module:
    """A tiny model of `family` with adapters everywhere by default, lora_B drawn non-zero (PEFT starts it at 0,
    where the adapter does nothing and lora_A gets no gradient)."""
    model = apply_lora(build(family, "eager"), LoraConfig(r=4, alpha=8, moe_adapter=moe_adapter, **changes), seed=0)
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = 0.5 * torch.randn(param.shape, generator=generator)
    return model


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.cat(documents())[None]
    return model(input_ids=ids, labels=ids).loss


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", FUSED)
def test_grouped_experts_give_the_folds_loss_and_adapter_gradients(family: str) -> None:
    fold, grouped = adapted(family, "peft"), adapted(family, "grouped")
    moe_layers = sum(name.endswith("mlp.experts") for name, _ in fold.named_modules())
    assert sum(isinstance(m, GroupedExpertsLora) for m in grouped.modules()) == moe_layers > 0
    assert not any(isinstance(m, GroupedExpertsLora) for m in fold.modules())
    fold_loss, grouped_loss = loss_of(fold), loss_of(grouped)
    fold_loss.backward()
    grouped_loss.backward()
    assert abs(grouped_loss.item() - fold_loss.item()) <= RTOL * fold_loss.item()
    fold_grads = {name: p.grad for name, p in fold.named_parameters() if p.requires_grad}
    grouped_grads = {name: p.grad for name, p in grouped.named_parameters() if p.requires_grad}
    assert fold_grads.keys() == grouped_grads.keys()
    assert sum(".experts." in name for name in fold_grads) == 4 * moe_layers  # (gate_up, down) × (A, B)
    for name, grad in fold_grads.items():
        assert grad.norm() > 0, name
        assert relative(grouped_grads[name], grad) <= RTOL, name
    grouped.zero_grad()
    with torch.no_grad():
        for name, param in grouped.named_parameters():
            if ".experts." in name and "lora_B" in name:
                param.zero_()
    dropped_loss = loss_of(grouped)
    dropped_loss.backward()
    assert abs(dropped_loss.item() - fold_loss.item()) > 100 * RTOL * fold_loss.item()
    expert_grads = {name: p.grad for name, p in grouped.named_parameters() if p.requires_grad and ".experts." in name}
    assert all(relative(grad, fold_grads[name]) > 100 * RTOL for name, grad in expert_grads.items())


def test_the_adapter_file_is_pefts_and_merges_into_the_same_model(tmp_path: Path) -> None:
    """What the grouped path saves loads with PeftModel.from_pretrained (PEFT's own forward) and merges into the
    base (export --merge-lora) to the same loss; the router carries no adapter and stays frozen in fp32."""
    grouped = adapted("glm4_moe", "grouped")
    router = grouped.get_base_model().model.layers[1].mlp.gate
    assert type(router).__name__ == "Glm4MoeTopkRouter"
    assert not router.weight.requires_grad and router.weight.dtype == torch.float32
    with torch.no_grad():
        expected = loss_of(grouped).item()
        grouped.save_pretrained(tmp_path)
        loaded = PeftModel.from_pretrained(build("glm4_moe", "eager"), tmp_path)
        assert not any(isinstance(m, GroupedExpertsLora) for m in loaded.modules())
        assert abs(loss_of(loaded).item() - expected) <= RTOL * expected
        merged = grouped.merge_and_unload()
        assert abs(loss_of(merged).item() - expected) <= RTOL * expected


def bf16_loss_and_grads(family: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One bf16-mixed step as a CPU with bf16 units runs it: frozen weights stored bf16, products under autocast."""
    model = adapted(family, "grouped")
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_of(model)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("family", FUSED)
def test_bf16_experts_on_rows_padded_per_expert_give_the_unpadded_loss_and_gradients(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 expert products on a CPU run on each expert's rows padded to ROW_BUCKET (oneDNN compiles a kernel per
    new row count): the real rows' results are the unpadded ones."""
    padded_loss, padded_grads = bf16_loss_and_grads(family)
    calls = []
    monkeypatch.setattr(moe_lora, "_bucketed", lambda *args: calls.append(1) or moe_lora._bucketed(*args))
    monkeypatch.setattr(moe_lora, "_compiles_per_shape", lambda experts, tokens: False)
    plain_loss, plain_grads = bf16_loss_and_grads(family)
    assert not calls
    assert abs(padded_loss - plain_loss) <= 1e-3 * abs(plain_loss)
    assert padded_grads.keys() == plain_grads.keys() and any(".experts." in name for name in padded_grads)
    for name, grad in plain_grads.items():
        assert relative(padded_grads[name], grad) <= 1e-2, name


def test_each_expert_s_rows_are_padded_with_zero_rows_to_a_multiple_of_the_bucket() -> None:
    expert_ids = torch.tensor([0, 0, 0, 2, 3, 3])
    tokens = torch.arange(1.0, 7.0)[:, None].repeat(1, 4)
    counts = moe_lora.expert_counts(expert_ids, 4)
    padded, padded_ids, padded_counts, rows = moe_lora._bucketed(tokens, expert_ids, counts)
    bucket = moe_lora.ROW_BUCKET
    assert padded_counts.tolist() == [bucket, 0, bucket, bucket]
    assert torch.equal(padded[rows], tokens) and padded.shape == (3 * bucket, 4)
    assert padded.abs().sum() == tokens.abs().sum()  # everything else is zero
    assert torch.equal(padded_ids[rows], expert_ids) and padded_ids.tolist() == sorted(padded_ids.tolist())


class _EmptyGroupsUnwritten(torch.utils._python_dispatch.TorchDispatchMode):
    """torch's `_grouped_mm` as it runs on Blackwell (pytorch#172439): a weight gradient's slices for the groups
    with no rows hold garbage (NaN here)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._grouped_mm.default and out.dim() == 3:  # 2-D x 2-D by groups: a weight gradient
            offsets = kwargs.get("offs", args[2] if len(args) > 2 else None)
            empty = torch.diff(offsets, prepend=offsets.new_zeros(1)) == 0
            out = out.masked_fill(empty.view(-1, 1, 1), float("nan"))
        return out


def test_an_expert_that_received_no_token_gets_an_exactly_zero_gradient_whatever_the_kernel_leaves() -> None:
    """Experts 1 and 3 of 4 get no row: their weight gradient is zero even where the kernel leaves garbage in it,
    and the others' is the loop over experts' (transformers' fallback)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 8, 16, generator=generator, requires_grad=True)
    rows = torch.randn(6, 8, generator=generator)
    offsets = torch.tensor([2, 2, 6, 6], dtype=torch.int32)
    upstream = torch.randn(6, 16, generator=generator)
    with _EmptyGroupsUnwritten():
        moe_lora.grouped_mm(rows, weight, offsets).backward(upstream)
    leaf = weight.detach().requires_grad_()
    (want,) = torch.autograd.grad(torch.ops.transformers.grouped_mm_fallback(rows, leaf, offsets), leaf, upstream)
    assert torch.equal(weight.grad[[1, 3]], torch.zeros(2, 8, 16))
    torch.testing.assert_close(weight.grad[[0, 2]], want[[0, 2]], rtol=1e-5, atol=1e-6)


class GroupedOperands(TorchDispatchMode):
    """The dtypes of the operands each grouped product (torch's kernel or transformers' loop) is given."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func._schema.name in ("aten::_grouped_mm", "transformers::grouped_mm_fallback"):
            self.dtypes.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_under_autocast_every_grouped_product_computes_in_its_dtype_with_fp32_adapters() -> None:
    """Without FSDP to cast them, the weights stay fp32 under bf16 autocast (the precision policy's fp32 frozen base
    included): every grouped product, the base's and the adapter's two, takes autocast's dtype as a linear layer's
    would (fp32 operands send torch's CUDA kernel to transformers' loop: offsets read on the host, one matmul an
    expert)."""
    model = adapted("qwen3_moe", "grouped")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with GroupedOperands() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        loss_of(model).backward()
    assert len(seen.dtypes) >= 6  # up and down: the base and the adapter's two, per MoE layer
    assert set(seen.dtypes) == {(torch.bfloat16, torch.bfloat16)}

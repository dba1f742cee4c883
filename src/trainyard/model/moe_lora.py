"""Expert LoRA as grouped low-rank products on the routed tokens.

PEFT 0.21 reaches fused 3-D experts with `ParamWrapper`, whose forward folds `W + scale·B·A` over the whole expert
stack (every expert, routed or not) before the experts run. Here the same PEFT modules keep their parameters, names,
init, saving, loading and merging, but the outermost wrapper of an experts module runs the experts the way
transformers' `grouped_mm` implementation does (tokens sorted by expert, one grouped product per projection) and adds
each expert's adapter to its own tokens as two small grouped products, x·Aᵀ then ·Bᵀ: no tensor the size of an
expert stack is made for the adapter, forward or backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from peft.tuners.lora import ParamWrapper
from torch._subclasses.fake_tensor import FakeTensor
from transformers.integrations.moe import _can_use_grouped_mm

from trainyard.model import nf4_experts

PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")
"""The fused expert parameters the grouped path adapts (transformers' names for every family with 3-D experts)."""

LowRank = tuple[torch.Tensor, torch.Tensor, float]
"""(first [E, in, r], second [E, r, out], scale): an expert's update to x is scale · x @ first[e] @ second[e]."""


class GroupedExpertsLora(ParamWrapper):
    """The outermost PEFT wrapper of a fused experts module, run as grouped products (PEFT's own forward when an
    adapter is merged, disabled, or more than one is active, which the fold handles)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        chain = wrapper_chain(self)
        adapters = low_rank_factors(chain) if not kwargs else None
        if adapters is None:
            return super().forward(hidden_states, *args, **kwargs)
        top_k_index, top_k_weights = args
        return grouped_experts_forward(chain[-1].get_base_layer(), adapters, hidden_states, top_k_index, top_k_weights)


def use_grouped_expert_adapters(model: torch.nn.Module) -> int:
    """Run every adapted fused experts module through `GroupedExpertsLora`; returns how many.

    A class swap rather than a bound method, so the module stays PEFT's (state dict, merge, save) and survives
    deepcopy; only modules whose every wrapped parameter is a 3-D expert projection of a transformers experts
    class (`use_experts_implementation`) are swapped."""
    wrappers = [module for module in model.modules() if type(module) is ParamWrapper]
    inner = {id(wrapper.base_layer) for wrapper in wrappers}
    outermost = [wrapper for wrapper in wrappers if id(wrapper) not in inner]
    for wrapper in outermost:
        if _grouped_capable(wrapper_chain(wrapper)):
            wrapper.__class__ = GroupedExpertsLora
    return sum(isinstance(wrapper, GroupedExpertsLora) for wrapper in outermost)


def wrapper_chain(outer: ParamWrapper) -> list[ParamWrapper]:
    """PEFT nests one ParamWrapper per adapted parameter of a module: outermost first."""
    chain = [outer]
    while isinstance(chain[-1].base_layer, ParamWrapper):
        chain.append(chain[-1].base_layer)
    return chain


def low_rank_factors(chain: list[ParamWrapper]) -> dict[str, LowRank] | None:
    """Each wrapped projection's single active adapter as factors in x @ W order; None where PEFT's own forward
    must run (an adapter merged or disabled, several active)."""
    factors: dict[str, LowRank] = {}
    for wrapper in chain:
        if wrapper.disable_adapters or wrapper.merged:
            return None
        active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
        if len(active) > 1:
            return None
        if active:
            lhs, rhs, scale = delta_factors(wrapper, active[0])
            transposed = not wrapper._did_swap_in_out_features  # stored [E, in, out]: delta = lhs @ rhs
            first, second = (lhs, rhs) if transposed else (rhs.mT, lhs.mT)
            factors[wrapper.parameter_name] = (_grouped_layout(first), _grouped_layout(second), scale)
    return factors


def delta_factors(wrapper: ParamWrapper, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """PEFT's `get_delta_factors`, which reads the wrapped parameter only for its dtype: for a stack held in NF4
    that read would dequantize the whole stack, so its dtype comes from the NF4 weights (PEFT's steps otherwise)."""
    base = wrapper.get_base_layer()
    if nf4_experts.quantized_stack(base, wrapper.parameter_name) is None:
        return wrapper.get_delta_factors(adapter)
    dtype, _ = nf4_experts.dtype_and_device(base, wrapper.parameter_name)
    experts, weight_a, weight_b = wrapper.num_experts, wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
    weight_a = weight_a.reshape(experts, -1, weight_a.shape[-1])  # [E, r, in]
    weight_b = weight_b.reshape(weight_b.shape[0], -1, experts).permute(2, 0, 1)  # [E, out, r]
    lhs, rhs = (weight_b, weight_a) if wrapper._did_swap_in_out_features else (weight_a.mT, weight_b.mT)
    return lhs.to(dtype), rhs.to(dtype), wrapper.scaling[adapter]


def grouped_experts_forward(
    experts: torch.nn.Module,
    adapters: dict[str, LowRank],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' `grouped_mm_experts_forward` (sort by expert, grouped up/gate, down, weight, unsort), with
    each projection's adapter applied to the tokens routed to each expert. Under expert parallelism the experts
    module carries a `token_exchange` (parallel/expert_parallel.py) that runs the sorted rows on the ranks holding
    their experts; the routing weights are applied here, on the tokens' own rank, either way."""
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.size(-1)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    tokens = hidden_states[perm // num_top_k]
    routing = top_k_weights.reshape(-1)[perm]
    run = getattr(experts, "token_exchange", None) or experts_on_sorted
    out = run(experts, adapters, tokens, expert_ids)
    weighted = out * routing.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    final = weighted[inverse].view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final.to(hidden_states.dtype)


ROW_BUCKET = 32
"""Rows per expert are padded to a multiple of this where each new row count costs a kernel compilation."""


def experts_on_sorted(
    experts: torch.nn.Module, adapters: dict[str, LowRank], tokens: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """Every expert of `experts` on its rows (`tokens` sorted by `expert_ids`, ids of this module's experts),
    before the routing weights: up/gate, activation, down, optional post-expert norm."""
    counts = expert_counts(expert_ids, experts.num_experts)
    if not _compiles_per_shape(experts, tokens):
        return _experts_on_counts(experts, adapters, tokens, expert_ids, counts)
    padded, padded_ids, padded_counts, rows = _bucketed(tokens, expert_ids, counts)
    return _experts_on_counts(experts, adapters, padded, padded_ids, padded_counts)[rows]


def _compiles_per_shape(experts: torch.nn.Module, tokens: torch.Tensor) -> bool:
    """bf16 products on a CPU go to oneDNN, which compiles a kernel for each new shape: every expert's row count
    changes every step, so unpadded they compile all the time (a tiny-moe step 4x slower than fp32's). Not for the
    fake tensors of `estimate --trace`: the padding depends on the routing, which they do not hold."""
    dtype, device = nf4_experts.dtype_and_device(experts, "down_proj")
    real = not isinstance(tokens, FakeTensor)
    return real and device.type == "cpu" and dtype == torch.bfloat16


def _bucketed(
    tokens: torch.Tensor, expert_ids: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sorted rows with each expert's rows padded by zero rows to a multiple of ROW_BUCKET (a row's product
    depends on that row alone, so the real rows' results are unchanged), their expert ids and counts, and where each
    real row went."""
    counts = counts.long()
    padded_counts = (counts + ROW_BUCKET - 1) // ROW_BUCKET * ROW_BUCKET
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
    starts = torch.cumsum(counts, 0) - counts
    rows = padded_starts[expert_ids] + torch.arange(expert_ids.numel(), device=tokens.device) - starts[expert_ids]
    total = int(padded_counts.sum())
    padded = tokens.new_zeros(total, tokens.size(-1)).index_copy(0, rows, tokens)
    padded_ids = torch.repeat_interleave(torch.arange(counts.numel(), device=tokens.device), padded_counts,
                                         output_size=total)
    return padded, padded_ids, padded_counts, rows


def _experts_on_counts(
    experts: torch.nn.Module,
    adapters: dict[str, LowRank],
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    out = _project(experts, up_name, adapters.get(up_name), tokens, expert_ids, offsets)
    out = experts._apply_gate(out) if experts.has_gate else experts.act_fn(out)
    out = _project(experts, "down_proj", adapters.get("down_proj"), out, expert_ids, offsets)
    if experts.has_post_expert_norm:
        out = experts.post_expert_norm(out)
    return out


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Rows per expert, as transformers counts them: histc (a fixed-size output: fake tensors and CUDA graphs);
    CPU histc wants floats."""
    counted = expert_ids.float() if expert_ids.device.type in ("cpu", "mps") else expert_ids.int()
    return torch.histc(counted, bins=num_experts, min=0, max=num_experts - 1)


def _project(
    experts: torch.nn.Module,
    name: str,
    adapter: LowRank | None,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """One fused projection on expert-sorted rows: the frozen base as one grouped product, plus the adapter as two
    grouped products through rank r (never forming W + delta). A stack held in NF4 is dequantized for its product
    and again for its backward, not kept between them."""
    def base() -> torch.Tensor:
        weight = getattr(experts, name)
        return weight if experts.is_transposed else weight.mT

    if nf4_experts.quantized_stack(experts, name) is not None:
        out = _RebuiltWeightProduct.apply(x, offsets, base)
    else:
        out = grouped_mm(x, base(), offsets)
    if experts.has_bias:
        out = out + getattr(experts, f"{name}_bias")[expert_ids]
    if adapter is not None:
        first, second, scale = adapter
        out = out + scale * grouped_mm(grouped_mm(x, first, offsets), second, offsets)
    return out


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] (rows sorted by group) @ weight[g] [E, in, out] per group: torch's grouped_mm where it takes the
    operands (its kernels want 16-byte aligned strides), else transformers' loop over the groups (same op, autograd).
    Under autocast both operands take its dtype, as a linear layer's do: fp32 LoRA factors (no FSDP to cast them)
    would otherwise send the product to the loop, which reads the offsets on the host and runs one matmul a group."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else weight.dtype
    x, weight = x.to(dtype), weight.to(dtype)
    if _can_use_grouped_mm(x, weight, offsets) and _aligned(x) and _aligned(weight):
        if weight.requires_grad and torch.is_grad_enabled():
            weight = without_idle_expert_grads(weight, offsets)
        return torch.nn.functional.grouped_mm(x, weight, offs=offsets)
    return torch.ops.transformers.grouped_mm_fallback(x, weight, offsets)


class _RebuiltWeightProduct(torch.autograd.Function):
    """x @ weight[g] per group for a frozen `weight` rebuilt by a function (an NF4 stack dequantized) in the forward
    and again in the backward, so autograd keeps no layer's dense stack between them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, offsets: torch.Tensor, weight: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        ctx.weight, ctx.dtype = weight, x.dtype
        ctx.save_for_backward(offsets)
        return grouped_mm(x, weight(), offsets)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        (offsets,) = ctx.saved_tensors
        return grouped_mm(grad, ctx.weight().mT, offsets).to(ctx.dtype), None, None


def without_idle_expert_grads(weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`weight` [E, ...] as it is, whose gradient is exactly zero for each expert with no rows in `offsets`: torch's
    `_grouped_mm` leaves such an expert's weight gradient unwritten on Blackwell (pytorch#172439; Hopper writes
    zeros), and the garbage reached the optimizer. A mask on the device: no count is read on the host."""
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return _IdleExpertsZeroGrad.apply(weight, counts > 0)


class _IdleExpertsZeroGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, active: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(active)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (active,) = ctx.saved_tensors
        return grad.masked_fill(~active.view(-1, *[1] * (grad.dim() - 1)), 0), None


def _grouped_layout(factor: torch.Tensor) -> torch.Tensor:
    """A factor as grouped_mm reads it: Aᵀ is a view of lora_A that it takes; PEFT's Bᵀ has the expert index
    innermost, so it is copied (the adapter's size, [E, r, out], never an expert stack's)."""
    return factor if _aligned(factor) else factor.contiguous()


def _aligned(tensor: torch.Tensor) -> bool:
    size = tensor.element_size()
    strides_ok = all(stride * size % 16 == 0 for stride in tensor.stride() if stride != 1)
    return strides_ok and min(tensor.stride()[-2:]) == 1 and tensor.data_ptr() % 16 == 0


def _grouped_capable(chain: list[ParamWrapper]) -> bool:
    experts = chain[-1].get_base_layer()
    return (
        hasattr(experts, "has_gate")
        and hasattr(experts, "num_experts")
        and not getattr(experts, "_is_expert_parallel", False)
        and all(w.parameter_name in PROJECTIONS and w.get_param().ndim == 3 for w in chain)
    )

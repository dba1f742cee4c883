"""The estimate's low-bit weights: model.quantize nf4 (the frozen base in torchao's NF4, counted byte for byte from
its layout) and train.precision fp8 (the linears that compute in FP8, and FSDP2's FP8 all-gathers).

memory.py counts every weight at its dtype; `adjust` then corrects the parts these change: the nf4 base's own bytes,
what FSDP2 gathers of a block, the one weight at a time a product dequantizes or casts, autocast's copies of the
weights FP8 casts itself. Which weights: model.quantize's rule (frozen linear weights but the head's, fp32-kept ones
and those a fused kernel reads, whose size NF4's blocks divide; routed experts per expert) and precision's FP8 rule.
Each weight's block scales are quantized in scaler blocks model.nf4_fast.scaler_block chooses (a power of two up to
256 dividing its blocks): the estimate counts each weight's second-level scales from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainyard.config import JobConfig
from trainyard.precision import fp8_linears

NF4_BLOCK = 64
"""Values per NF4 block: each has an int8 scale."""
NF4_LEVELS = 16
"""NF4's lookup table, one per tensor, in the weight's dtype (with the scales' mean, one value)."""


@dataclass(frozen=True)
class LowBit:
    """Elements of the weights nf4 stores and fp8 computes with, over the model and in its largest block."""

    nf4: int = 0
    nf4_scalers: int = 0
    """Second-level scales of the NF4 weights (one a scaler block), and below: of the experts, in the largest block."""
    nf4_experts_scalers: int = 0
    nf4_block_scalers: int = 0
    nf4_block_experts_scalers: int = 0
    nf4_tensors: int = 0
    """NF4 tensors (a routed expert each): each keeps its own levels and mean."""
    nf4_experts: int = 0
    """Of `nf4`, the routed experts' (their stacks are gathered apart under expert parallelism)."""
    nf4_block: int = 0
    nf4_block_experts: int = 0
    nf4_largest: int = 0
    """The largest quantized linear weight: its product dequantizes it whole, one at a time."""
    nf4_largest_stack: int = 0
    """The largest routed-expert stack: its grouped products dequantize every expert of it at once."""
    fp8: int = 0
    fp8_trainable: int = 0
    fp8_block: int = 0
    fp8_largest: int = 0
    fp8_kept: tuple[str, ...] = ()
    """Linears FP8 kernels cannot take (a dimension not a multiple of 16): they stay bf16."""


def nf4_bytes(elements: float, scalers: float, tensors: int, element_bytes: int) -> float:
    """What torchao's NF4Tensor holds for `elements` values with `scalers` scaler blocks in `tensors` tensors of
    `element_bytes` per value: two 4-bit codes a byte, an int8 scale per block of 64, a scale of those scales per
    scaler block in the weight's dtype; per tensor the scales' mean and NF4's 16 levels in that dtype."""
    return nf4_gathered_bytes(elements, scalers, element_bytes) + tensors * (1 + NF4_LEVELS) * element_bytes


def nf4_gathered_bytes(elements: float, scalers: float, element_bytes: int) -> float:
    """What FSDP2 all-gathers of NF4 weights (torchao's fsdp_pre_all_gather): codes, int8 scales, their scales."""
    return elements / 2 + elements / NF4_BLOCK + scalers * element_bytes


def scaler_blocks(elements: int) -> int:
    """A weight's second-level scales: its blocks over its scaler block, as model.nf4_fast.scaler_block chooses it
    (the quantization's own rule; it imports no torchao)."""
    from trainyard.model.nf4_fast import scaler_block

    blocks = elements // NF4_BLOCK
    return blocks // scaler_block(blocks)


def count(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> LowBit:
    """The model's (meta-built, LoRA applied) weights nf4 would store and the linears fp8 would convert."""
    linears, stacks = _nf4_weights(model)
    converted, kept = fp8_linears(model)
    fp8 = {id(model.get_submodule(name)): model.get_submodule(name).weight for name in converted}

    def in_block(found: dict[int, int], block: torch.nn.Module) -> int:
        return sum(found.get(id(module), 0) for module in block.modules())

    stack_sizes = {key: size for key, (size, _, _, _) in stacks.items()}
    scalers = {key: scaler_blocks(size) for key, size in linears.items()}
    stack_scalers = {key: stack[3] for key, stack in stacks.items()}
    fp8_sizes = {key: weight.numel() for key, weight in fp8.items()}
    largest = max(blocks, key=lambda block: in_block(linears, block) + in_block(stack_sizes, block), default=None)
    return LowBit(
        nf4=sum(linears.values()) + sum(stack_sizes.values()),
        nf4_scalers=sum(scalers.values()) + sum(stack_scalers.values()),
        nf4_experts_scalers=sum(stack_scalers.values()),
        nf4_block_scalers=in_block(scalers, largest) + in_block(stack_scalers, largest) if largest is not None else 0,
        nf4_block_experts_scalers=in_block(stack_scalers, largest) if largest is not None else 0,
        nf4_tensors=len(linears) + sum(experts for _, experts, _, _ in stacks.values()),
        nf4_experts=sum(stack_sizes.values()),
        nf4_block=in_block(linears, largest) + in_block(stack_sizes, largest) if largest is not None else 0,
        nf4_block_experts=in_block(stack_sizes, largest) if largest is not None else 0,
        nf4_largest=max(linears.values(), default=0),
        nf4_largest_stack=max((largest for _, _, largest, _ in stacks.values()), default=0),
        fp8=sum(fp8_sizes.values()),
        fp8_trainable=sum(weight.numel() for weight in fp8.values() if weight.requires_grad),
        fp8_block=max((in_block(fp8_sizes, block) for block in blocks), default=0),
        fp8_largest=max(fp8_sizes.values(), default=0),
        fp8_kept=tuple(kept),
    )


def _nf4_weights(model: torch.nn.Module) -> tuple[dict[int, int], dict[int, tuple[int, int, int, int]]]:
    """By module id: the frozen linear weights NF4 takes (their size), and the frozen routed-expert stacks it takes
    per expert, as model.quantize.nf4_targets does (their size, NF4 tensors: one an expert, the largest stack's
    size, scaler blocks). A linear's size, or an expert's, must be a multiple of NF4_BLOCK."""
    from trainyard.model.build import kept_in_fp32
    from trainyard.model.layers import not_plain_linear

    fp32, skipped = kept_in_fp32(model, torch.bfloat16), set(not_plain_linear(model))
    head = model.get_output_embeddings()
    linears: dict[int, int] = {}
    stacks: dict[int, tuple[int, int, int, int]] = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            weight = module.weight
            if not (module is head or weight.requires_grad or fp32(f"{name}.weight") or name in skipped
                    or weight.numel() % NF4_BLOCK):
                linears[id(module)] = weight.numel()
        found = [param for key, param in module.named_parameters(recurse=False)
                 if param.dim() == 3 and "experts" in f"{name}.{key}" and not param.requires_grad
                 and not fp32(f"{name}.{key}") and param[0].numel() % NF4_BLOCK == 0]
        if found:
            stacks[id(module)] = (sum(p.numel() for p in found), sum(p.shape[0] for p in found),
                                  max(p.numel() for p in found),
                                  sum(p.shape[0] * scaler_blocks(p[0].numel()) for p in found))
    return linears, stacks


def adjust(parts: Any, cfg: JobConfig, low: LowBit, size: Any, layout: Any, sharded: bool) -> None:
    """memory.py's parts (its Memory), each weight counted at its dtype (Dtypes) in its Layout, corrected for nf4's
    and fp8's weights. Its types are not imported here: memory.py imports this module."""
    gather = size.compute if size.mixed else size.master  # what FSDP2 gathers a weight in (_fsdp_buffers)
    if cfg.model.quantize == "nf4" and low.nf4:
        held = nf4_bytes(low.nf4, low.nf4_scalers, low.nf4_tensors, size.frozen)
        parts.weights += (held - low.nf4 * size.frozen) / layout.shard
        if sharded:
            apart = 1 - _experts_gathered(layout)
            gathered = low.nf4_block - low.nf4_block_experts * apart
            scalers = low.nf4_block_scalers - low.nf4_block_experts_scalers * apart
            parts.fsdp_buffers += 2 * (nf4_gathered_bytes(gathered, scalers, size.frozen) - gathered * gather)
        dequantized = max(low.nf4_largest, low.nf4_largest_stack / layout.expert_parallel)
        parts.low_bit_copies += dequantized * size.compute
        parts.notes.append(
            f"nf4: {low.nf4 / 1e9:.3g}B frozen weights in 4 bits with their scales "
            f"({held / low.nf4:.4f} bytes each, {held / layout.shard / 2**30:.2f} GiB per device), "
            f"{'gathered in 4 bits, ' if sharded else ''}each dequantized to the compute dtype for its product")
    if cfg.train.precision == "fp8" and low.fp8:
        fp8_gathers = sharded and cfg.train.fp8_scaling == "tensorwise"
        if fp8_gathers:
            parts.fsdp_buffers -= 2 * low.fp8_block * (gather - 1)
        if size.mixed and not sharded:  # Float8Linear casts fp32 weights to FP8 itself: no autocast copy of them
            parts.mixed_precision_copies -= low.fp8_trainable * size.compute
        parts.low_bit_copies += 2 * low.fp8_largest  # one weight in FP8 at a time, and its transpose for backward
        kept = f"; {len(low.fp8_kept)} stay bf16 (dimensions not multiples of 16)" if low.fp8_kept else ""
        parts.notes.append(f"fp8 ({cfg.train.fp8_scaling}): {low.fp8 / 1e9:.3g}B weights of linears compute in FP8"
                           f"{', all-gathered in FP8' if fp8_gathers else ''}{kept}")


def gather_saving(cfg: JobConfig, low: LowBit, gather: int, frozen: int) -> float:
    """Bytes per whole-model gather FSDP2 no longer moves (routed experts apart): nf4's base, fp8 tensorwise's
    linears."""
    saved = 0.0
    if cfg.model.quantize == "nf4":
        dense = low.nf4 - low.nf4_experts
        saved += dense * gather - nf4_gathered_bytes(dense, low.nf4_scalers - low.nf4_experts_scalers, frozen)
    if cfg.train.precision == "fp8" and cfg.train.fp8_scaling == "tensorwise":
        saved += low.fp8 * (gather - 1)
    return saved


def _experts_gathered(layout: Any) -> float:
    """The share of a block's routed experts FSDP2 gathers on a rank: all without EP; under EP its experts / N,
    only where they are sharded again (the shard group is larger than EP)."""
    ep = layout.expert_parallel
    return 1.0 if ep <= 1 else (1.0 / ep if layout.shard > ep else 0.0)

"""model.quantize nf4: LoRA's frozen base linears stored in 4-bit NF4 (torchao's NF4Tensor), the rest as it was.

The weights to quantize are chosen on the plain model (every linear layer's weight but the head's, the routers' kept
in fp32 and the ones a parent hands to a fused kernel), so training and export pick the same ones. Before the
model is sharded, each becomes an NF4Tensor on the meta device: FSDP2 shards it as its own type (torchao implements
FSDP2's all-gather hooks) and materialises 4-bit shards; no full-precision copy of it is ever allocated. Loading
streams each weight in row chunks and quantizes only this rank's rows (nf4_fast): NF4's scales share one mean over
the whole tensor's block absmax, which every rank takes from the stream, so each holds what torchao's quantization
of the whole tensor would give it, and gathers the same weight as the others.

NF4 takes blocks of 64 values, whose scales are quantized in scaler blocks of up to 256 (the largest power of two
dividing the weight's blocks in a multiple of 8 scaler blocks: nf4_fast.scaler_block): a weight whose size 64 does
not divide stays in model.dtype (said in the log); under FSDP2 each rank's rows must hold whole scaler blocks too.
MoE experts fused in 3-D are quantized per expert, each expert's [out, in] an NF4Tensor of its own (nf4_experts.py),
under the same rules for each expert's size and rows. Products dequantize each weight in chunks (nf4_linear.py):
torchao's dequantization holds ~8x the dense copy at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from trainyard.errors import ConfigError
from trainyard.model import nf4_experts, nf4_fast, nf4_linear
from trainyard.model.nf4_fast import BLOCK, nf4_module, scaler_block

NF4_LEVELS = 16


class Targets(NamedTuple):
    """What model.quantize nf4 stores in 4 bits, by checkpoint name, and what it leaves in the model's dtype."""

    quantized: list[str]
    left: list[str]
    nbytes: int
    """What the quantized weights hold as NF4Tensors, scales and their scales included."""
    values: int
    """The quantized weights' values."""


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is an NF4Tensor (False without importing torchao where nothing has)."""
    return type(tensor).__name__ == "NF4Tensor"


def nf4_targets(model: torch.nn.Module, dtype: torch.dtype) -> Targets:
    """The weights NF4 stores, and those it leaves in `dtype` (one whose size, or each expert's, is not a multiple
    of BLOCK), by checkpoint name, on the plain model (before LoRA): linear layers' weights but the head's,
    fp32-kept ones, and those a parent reads past the layer's forward; fused 3-D expert stacks, per expert."""
    from trainyard.model.build import kept_in_fp32  # both only where a job quantizes: weights.py imports this
    from trainyard.model.layers import not_plain_linear

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kept = kept_in_fp32(model, dtype)
    not_plain = not_plain_linear(model)
    weights = [(f"{name}.weight", 1, module.weight.numel()) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and module is not head and name not in not_plain
               and module.weight.dim() == 2]
    weights += [(name, param.shape[0], param[0].numel()) for name, param in model.named_parameters()
                if param.dim() == 3 and "experts" in name]
    quantized, left, nbytes, values = [], [], 0, 0
    for key, experts, numel in weights:
        if kept(key):
            continue
        if numel % BLOCK:
            left.append(key)
            continue
        quantized.append(key)
        nbytes += experts * nf4_nbytes(numel, scaler_block(numel // BLOCK), dtype)
        values += experts * numel
    return Targets(quantized, left, nbytes, values)


def nf4_nbytes(numel: int, size: int, dtype: torch.dtype) -> int:
    """What an NF4Tensor of `numel` values in scaler blocks of `size` holds: two codes a byte, an int8 scale a
    block; a factor a scaler block, NF4's 16 levels and the scales' mean in the weight's `dtype`."""
    blocks = numel // BLOCK
    item = torch.empty(0, dtype=dtype).element_size()
    return numel // 2 + blocks + blocks // size * item + (NF4_LEVELS + 1) * item


def quantize_meta(model: torch.nn.Module, targets: set[str], shards: int, device: torch.device,
                  checkpoint_key: Callable[[str], str], expert_parallel: int = 1) -> int:
    """Each target weight (still on meta; found by `checkpoint_key` of its name in the model) as a meta NF4Tensor,
    before the model is sharded over `shards` ranks; returns how many. A weight whose rows or blocks `shards` does
    not divide is refused, naming it. Fused expert stacks become one NF4Tensor per expert (nf4_experts), sharded
    over `shards` / `expert_parallel` ranks."""
    nf4 = nf4_module()
    done = nf4_experts.quantize_experts_meta(model, targets, shards, device, checkpoint_key, expert_parallel)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) or checkpoint_key(f"{name}.weight") not in targets:
            continue
        size = scaler_block(weight.numel() // BLOCK)
        nf4_fast.check_shards(checkpoint_key(f"{name}.weight"), weight.shape, size, shards)
        module.weight = torch.nn.Parameter(nf4_fast.meta_nf4(nf4, weight.shape, weight.dtype, device, size),
                                           requires_grad=False)
        if type(module) is torch.nn.Linear:  # a subclass keeps its own forward (torchao's linear_nf4 then)
            module.__class__ = nf4_linear.NF4Linear
        done += 1
    return done


def refuse_lone_shards(shards: int, world: int, where: str | None) -> None:
    """FSDP2 over shard groups of one rank among several (hsdp with dist.shard_size 1, DiLoCo sites of one rank)
    copies a lone rank's weight as one tensor, which an NF4Tensor's three parts are not: its gather fails."""
    if shards == 1 and world > 1:
        raise ConfigError(
            f"model.quantize nf4: the {world} ranks shard each weight within groups of one rank, where FSDP2 cannot "
            "gather NF4 weights",
            where=where,
            fix="set dist.strategy: ddp (a one-rank shard group holds the whole model anyway), or a dist.shard_size "
            "of 2 or more, or model.quantize: none",
        )


@torch.no_grad()
def fill_own_rows(local: torch.Tensor, read: Callable[[int, int], torch.Tensor], shape: torch.Size, start: int,
                  stop: int) -> None:
    """This rank's rows [start, stop) of a `shape` tensor, read in row chunks by `read(a, b)`, quantized as the
    whole tensor (bit for bit torchao's `to_nf4` of it, then split) into the NF4 `local` (its shard, or all of it).
    A fake one (`estimate --trace`'s step) holds no values: nothing is quantized, so no fake code table is cached.
    """
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(local.quantized_data):
        return
    parts = nf4_fast.quantize_rows(read, (shape[0], shape[1]), start, stop, local.dtype, local.scaler_block_size)
    nf4 = nf4_module()
    local.copy_(nf4.NF4Tensor(*nf4.construct_nf4_args(local, {**vars(parts), "device": torch.device("cpu")})))


@torch.no_grad()
def round_trip(model: torch.nn.Module, targets: list[str], dtype: torch.dtype | None = None) -> int:
    """Each target weight of a whole plain model replaced by its NF4 value dequantized (a fused expert stack's, each
    expert's own): the base training saw, for an export to merge the adapter into. `dtype`: the one training
    quantized the weights in (its frozen base's: the scales are computed in it), where it is not the model's.
    Returns how many."""

    params = dict(model.named_parameters())
    for name in targets:
        weight = params[name]
        for matrix in (weight.unbind(0) if weight.dim() == 3 else (weight,)):
            values = matrix.detach().cpu().to(dtype or matrix.dtype).contiguous()
            matrix.copy_(nf4_fast.to_nf4(values).get_original_weight())
    return len(targets)


def describe(quantized: list[str], left: list[str], nbytes: int, values: int) -> str:
    """'14 linear weights in NF4 (1.05M values in 0.52 MiB with their scales, 0.5159 bytes a value); left in the
    model's dtype (...): ...'; '26 linear weights and 4 expert stacks (per expert) in NF4 (...)' with experts."""
    stacks = sum(".experts." in f".{name}" and not name.endswith(".weight") for name in quantized)
    words = f"{len(quantized) - stacks} linear weights"
    words += f" and {stacks} expert stacks (per expert) in NF4" if stacks else " in NF4"
    if values:
        words += (f" ({values / 1e6:.3g}M values in {nbytes / 2**20:.3g} MiB with their scales, "
                  f"{nbytes / values:.4f} bytes a value)")
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        words += f"; left in the model's dtype (size not a multiple of {BLOCK}; a stack's, each expert's): {shown}"
    return words

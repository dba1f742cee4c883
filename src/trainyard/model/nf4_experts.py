"""model.quantize nf4 for MoE experts fused in 3-D: each expert's [out, in] matrix its own NF4Tensor.

torchao's NF4Tensor is 2-D, and one over a whole [experts x out, in] stack would share one scales' mean across every
expert (and refuse expert parallelism's slice at a start row). So a stack becomes an `NF4ExpertStack`: a list of
frozen NF4 parameters, one per expert, each quantized as `to_nf4` of that expert alone would be. They are plain 2-D
NF4 weights to the rest of the machinery: FSDP2/HSDP shard each one's rows like a linear's (torchao's all-gather
hooks), loading fills each from its expert's rows, and expert parallelism keeps this rank's experts of the list.

The list sits beside the projection's name (`experts.gate_up_proj_nf4.3`: this rank's expert 3 of the checkpoint's
`experts.gate_up_proj`, read from its rows by weights.py through `stack_expert`), and the experts module's class
gains one thing: reading the projection (`experts.gate_up_proj`) gives the dense [experts, out, in] stack,
dequantized then, so transformers' forwards, PEFT and moe_lora's grouped products read it as they read the
parameter. moe_lora's grouped path rebuilds it in the backward instead of keeping it: one dense stack at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from trainyard.errors import ModelError
from trainyard.model import nf4_fast, nf4_linear
from trainyard.model.nf4_fast import BLOCK, nf4_module, scaler_block


class NF4ExpertStack(torch.nn.ParameterList):
    """One fused expert stack, each (held) expert's [out, in] weight a frozen NF4Tensor."""

    def dequantized(self) -> torch.Tensor:
        """The dense [experts, out, in] stack in the weights' dtype."""
        return nf4_linear.dequantize_stack(list(self))

    def kept(self, start: int, count: int) -> NF4ExpertStack:
        """Experts [start, start + count) alone (expert parallelism's share of a rank)."""
        return NF4ExpertStack([self[index] for index in range(start, start + count)])


SUFFIX = "_nf4"
"""A quantized projection's list of experts is registered as the projection's name and this."""
_STACK_EXPERT = re.compile(rf"(.+){SUFFIX}\.(\d+)")


def stack_expert(key: str) -> tuple[str, int] | None:
    """The fused stack's checkpoint name and the expert (of this rank's, counted from its first) that a per-expert
    NF4 weight's name (checkpoint_key of it) holds; None for any other name."""
    found = _STACK_EXPERT.fullmatch(key)
    return (found[1], int(found[2])) if found else None


def as_whole_stacks(entries: list[tuple[str, tuple[int, ...]]], ranks: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters' (name, shape), each quantized stack's per-expert weights as the one [experts, out, in] stack they
    stand for (this rank's experts on each of `ranks` EP ranks), in place of the first: the same at any EP size."""
    merged: dict[str, tuple[int, ...]] = {}
    experts: dict[str, int] = {}
    for name, shape in entries:
        found = _STACK_EXPERT.fullmatch(name)
        if found is None:
            merged[name] = shape
            continue
        experts[found[1]] = experts.get(found[1], 0) + 1
        merged[found[1]] = (experts[found[1]] * ranks, *shape)
    return list(merged.items())


def _read_dense(self: torch.nn.Module, name: str) -> Any:
    stack = self._modules.get(f"{name}{SUFFIX}")
    return stack.dequantized() if isinstance(stack, NF4ExpertStack) else torch.nn.Module.__getattr__(self, name)


@cache
def _dequantizing(base: type) -> type:
    """`base` (a transformers experts class) whose quantized stacks read as their dense dequantized stacks."""
    return type(f"NF4{base.__name__}", (base,), {"__getattr__": _read_dense, "__module__": base.__module__})


def stacks_of(experts: torch.nn.Module) -> dict[str, NF4ExpertStack]:
    """The experts module's quantized stacks, by projection name."""
    return {name.removesuffix(SUFFIX): module for name, module in experts._modules.items()
            if isinstance(module, NF4ExpertStack)}


def quantized_stack(experts: torch.nn.Module, name: str) -> NF4ExpertStack | None:
    found = experts._modules.get(f"{name}{SUFFIX}")
    return found if isinstance(found, NF4ExpertStack) else None


def keep_experts(experts: torch.nn.Module, start: int, count: int) -> list[str]:
    """Keep experts [start, start + count) of each quantized stack (expert parallelism); returns the stacks' names."""
    for name, stack in stacks_of(experts).items():
        experts._modules[f"{name}{SUFFIX}"] = stack.kept(start, count)
    return list(stacks_of(experts))


def dtype_and_device(experts: torch.nn.Module, name: str) -> tuple[torch.dtype, torch.device]:
    """A projection's dtype and device, without dequantizing a quantized one."""
    stack = quantized_stack(experts, name)
    weight = next(iter(stack)) if stack is not None else getattr(experts, name)
    return weight.dtype, weight.device


def expert_count(experts: torch.nn.Module) -> int | None:
    """The experts of a module holding quantized stacks (this rank's under expert parallelism); None without."""
    return next((len(stack) for stack in stacks_of(experts).values()), None)


def quantize_experts_meta(model: torch.nn.Module, targets: set[str], shards: int, device: torch.device,
                          checkpoint_key: Callable[[str], str], expert_parallel: int = 1) -> int:
    """Each target 3-D stack (on meta; found by `checkpoint_key` of its name in the model) as an NF4ExpertStack of
    meta NF4Tensors, before the model is sharded over `shards` ranks, or under expert parallelism over `shards` /
    `expert_parallel` (each expert's rows split in whole scaler blocks, or refused naming it); returns how many
    stacks."""
    nf4 = nf4_module()
    if expert_parallel > 1:
        _check_expert_shards(model, targets, shards, expert_parallel, checkpoint_key)
        shards //= expert_parallel
    done = 0
    for name, module in model.named_modules():
        found = [key for key, param in module._parameters.items()
                 if param is not None and param.dim() == 3 and checkpoint_key(f"{name}.{key}") in targets]
        for key in found:
            param = module._parameters.pop(key)
            experts, shape = param.shape[0], param.shape[1:]
            size = scaler_block(shape.numel() // BLOCK)
            nf4_fast.check_shards(f"{checkpoint_key(f'{name}.{key}')} (each expert)", shape, size, shards)
            module.register_module(f"{key}{SUFFIX}", NF4ExpertStack([
                torch.nn.Parameter(nf4_fast.meta_nf4(nf4, shape, param.dtype, device, size), requires_grad=False)
                for _ in range(experts)]))
            done += 1
        if found and type(module).__getattr__ is not _read_dense:
            module.__class__ = _dequantizing(type(module))
    return done


def _check_expert_shards(model: torch.nn.Module, targets: set[str], shards: int, expert_parallel: int,
                         checkpoint_key: Callable[[str], str]) -> None:
    """FSDP2 shards each EP rank's experts over shards / expert_parallel ranks; where that is one rank, torch's FSDP2
    copies a lone rank's weight as one tensor, which an NF4Tensor's three parts are not (its gather fails)."""
    stacked = any(param.dim() == 3 and checkpoint_key(name) in targets for name, param in model.named_parameters())
    if stacked:
        refuse_lone_expert_shards(shards, expert_parallel)


def refuse_lone_expert_shards(shards: int, expert_parallel: int, where: str | None = None) -> None:
    """Quantized expert stacks, each sharded over shards / expert_parallel ranks: one rank is refused (the dry run
    asks too, for a model with stacks NF4 takes)."""
    if shards // expert_parallel == 1:
        raise ModelError(
            f"model.quantize nf4: under dist.expert_parallel {expert_parallel} over a shard dimension of {shards} "
            "ranks each expert stack is sharded over one rank, where FSDP2 cannot gather NF4 weights",
            where=where,
            fix=f"set dist.expert_parallel to a divisor of {shards} below it (each expert then sharded over 2 or "
            "more ranks), dist.expert_parallel: 1, or model.quantize: none",
        )


def quantizable_stacks(model: torch.nn.Module) -> bool:
    """Whether the (meta, LoRA-wrapped or plain) model has frozen fused expert stacks of whole NF4 blocks."""
    return any(param.dim() == 3 and "experts" in name and not param.requires_grad and param[0].numel() % BLOCK == 0
               for name, param in model.named_parameters())

"""What `estimate --trace` runs in place of the job's kernels where those cannot run on CPU fake tensors, each holding
the tensors the job's kernel holds: the attention the job chooses, torch's grouped product in any dtype, EP's token
exchange with the split sizes balanced routing gives (fake tensors hold no expert ids to count), and DDP's reduction
as a Python hook."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist
from torch._meta_registrations import _create_grouped_mm_output_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from trainyard import dist
from trainyard.model import attention
from trainyard.model.moe_lora import LowRank, experts_on_sorted
from trainyard.parallel import expert_parallel

FUSED = "trainyard_trace_fused"
"""Stands in for flash-attention and flex_attention: what they save (the output and its log-sum-exp, no scores) is
what sdpa's fused kernel saves on a CPU."""


def fused_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa's causal kernel, without what a fused kernel applies to its scores in place: soft-capping, sinks,
    windows and document bounds change values, not what is held (sdpa refuses the first two, and a mask for the
    others would hold [L, L] where flash and flex hold none). Values narrower than keys (MLA) are padded to the keys'
    width, as transformers pads them for flash-attention, so the CPU's fused kernel takes them too."""
    dropped = ("softcap", "s_aux", "sliding_window")
    kwargs = {name: value for name, value in kwargs.items() if name not in dropped}
    width = value.shape[-1]
    if width < query.shape[-1]:
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    out = sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)[0]
    return out[..., :width], None


AttentionInterface.register(FUSED, fused_attention)
AttentionMaskInterface.register(FUSED, flash_attention_mask)


def traced_attention(requested: str, model: torch.nn.Module, packed: bool, where: str | None, device: str) -> str:
    """The implementation the job chooses on its `device` ("cuda" or "cpu"), refusing what the job refuses, as it
    runs here. On a CPU the job's own choice: varlen (each document as that CPU runs it), sdpa or eager. On GPUs
    varlen, sdpa and eager themselves; flash-attention and flex_attention (auto's choices where flash keeps every
    feature of the family, or for soft-capping and sinks) as FUSED."""
    if device == "cpu":
        return attention.choose(requested, model, torch.device("cpu"), where=where, packed=packed)
    attention.refuse_dropped(requested, model, where, packed)
    if requested == "auto":
        dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
        chosen = attention.auto_choice(attention.features(model, packed), "cuda", True, dropout)
        return attention.VARLEN if chosen == attention.VARLEN else FUSED
    if requested in (*attention.FLASH, "flex_attention"):
        return FUSED
    return attention.VARLEN if requested == "varlen" else requested


class GroupedMmInAnyDtype(TorchDispatchMode):
    """torch's fake (meta) `_grouped_mm` takes bf16 only, as its sm90 fast path does; its CPU and CUDA kernels also
    multiply fp32 (the experts of an fp32 job, or of fp32 masters under autocast, which grouped_mm does not cast).
    Here such a product gets the output torch's own meta function shapes, in the inputs' dtype."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            mat_a, mat_b, *rest = args
            offs = rest[0] if rest else kwargs.get("offs")
            out_dtype = rest[2] if len(rest) > 2 else kwargs.get("out_dtype")
            return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return func(*args, **kwargs)


class BalancedExchange(expert_parallel.TokenExchange):
    """EP's exchange where every rank sends each rank (itself included) an equal share of its routed rows, spread
    evenly over that rank's experts: the all-to-alls and grouped products of the job at balanced routing."""

    def __call__(
        self, experts: torch.nn.Module, adapters: dict[str, LowRank], rows: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        local = self.experts // self.ranks
        splits = _even(rows.size(0), self.ranks)
        arrived = dist.all_to_all_rows(rows, splits, splits, self.group)
        local_ids = torch.arange(arrived.size(0)) * local // max(arrived.size(0), 1)  # sorted, evenly spread
        out = experts_on_sorted(experts, adapters, arrived, local_ids)
        return dist.all_to_all_rows(out, splits, splits, self.group)


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def balanced_exchanges(model: torch.nn.Module) -> None:
    """Each EP expert stack's token exchange as `BalancedExchange` (no-op without EP)."""
    for module in model.modules():
        exchange = getattr(module, "token_exchange", None)
        if isinstance(exchange, expert_parallel.TokenExchange):
            module.token_exchange = BalancedExchange(exchange.group, exchange.ranks, exchange.experts)


def all_reduce_hook(group: torch_dist.ProcessGroup, bucket: torch_dist.GradBucket) -> torch.futures.Future:
    """DDP's default reduction (sum, then divide by the group), as a Python comm hook: the fake group's work has no
    result for DDP's built-in C++ hook to read."""
    torch_dist.all_reduce(bucket.buffer(), group=group)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(bucket.buffer().div_(group.size()))
    return done


def hooked(model: torch.nn.Module) -> torch.nn.Module:
    """The parallelized model, its DDP reduction (if any) through all_reduce_hook."""
    if isinstance(model, DistributedDataParallel):
        # DDP checks a hook's annotations as types, and this module's are strings (postponed): a bare lambda passes.
        model.register_comm_hook(model.process_group, lambda group, bucket: all_reduce_hook(group, bucket))
    return model

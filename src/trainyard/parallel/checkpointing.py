"""Activation checkpointing (full or torchtitan's selective policy): the first step of the parallelize order, before
compile (compile.py) and sharding.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainyard.model.build import decoder_blocks, is_peft

MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default})
ATTENTION_OPS = frozenset(
    {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    }
)

GROUPED_PRODUCTS = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback"})
"""The experts' grouped products (torch's kernel, transformers' loop where torch's does not take the operands), by
schema name: transformers registers its op only once an MoE family is imported."""
COMMUNICATION_OPS = frozenset({"_c10d_functional::all_to_all_single"})
"""Expert parallelism's token exchange: recomputing it would send every routed row across the ranks again."""


def _lora_rank(model: torch.nn.Module) -> int:
    """The widest adapter rank; 0 without LoRA, and PEFT (which model.lora imports) not loaded for it."""
    if not is_peft(model):
        return 0
    from trainyard.model.lora import max_lora_rank

    return max_lora_rank(model)


def enable_activation_checkpointing(model: torch.nn.Module, selective: bool = False) -> None:
    """Checkpoint every decoder layer through transformers' own hook: it wraps the layer's `forward`, so FSDP2's
    hooks stay outside the recompute and parameter names stay as they are. Non-reentrant, so LoRA + DDP +
    checkpointing trains (the reentrant kind crashes there). `selective`: see `selective_policy`."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, selective_policy(_lora_rank(model)))
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def selective_policy(low_rank: int) -> Callable[..., CheckpointPolicy]:
    """torchtitan's op-level policy: keep the outputs of attention, of the matmuls and the experts' grouped products,
    the ops that cost the most to recompute, and of EP's all-to-alls, which would cross the network again; recompute
    everything between them (norms, activations, rotary, casts, adds).

    Except matmuls through at most `low_rank` (LoRA's B: rank-r products): each output element cost only 2r
    flops, and keeping them, as large as the base layer's own outputs, would hold more than no checkpointing."""

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = op._schema.name
        if op in ATTENTION_OPS or name in COMMUNICATION_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMUL_OPS and args[1 if op == torch.ops.aten.addmm.default else 0].shape[-1] > low_rank:
            return CheckpointPolicy.MUST_SAVE
        if name in GROUPED_PRODUCTS and args[0].shape[-1] > low_rank:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy

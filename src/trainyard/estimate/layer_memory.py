"""`trainyard estimate`, one decoder layer's activations: what autograd saves in a block per token, for the families
whose blocks are alike (attention and an MLP) and, block by block, for those that put state layers beside or instead
of attention (estimate/state_memory.py), where blocks differ in what they hold: attention or not, a dense MLP, MoE
or none, their own norms and adapters."""

from __future__ import annotations

from trainyard.config import JobConfig
from trainyard.estimate import attention_memory, state_memory
from trainyard.estimate.arch import Block, Counts, Shape
from trainyard.estimate.elements import Dtypes
from trainyard.hardware import Gpu

EXPERT_INTERMEDIATES = {"gpt_oss": 7, "nemotron_h": 2}
"""Intermediates of expert width each routed (token, expert) pair saves, where not the gated MLP's four: gpt-oss's
clamped SwiGLU keeps gate_up (two), the clamped gate, its sigmoid, the product, up + 1 and the gated output;
Nemotron-H's ungated experts up and its relu²."""


def stack_per_token(cfg: JobConfig, shape: Shape, counts: Counts, size: Dtypes, kind: Gpu, document: int) -> float:
    """Every decoder layer's saved bytes per token."""
    if not counts.blocks:
        return shape.layers * layer_bytes_per_token(cfg, shape, counts, size, kind, document)
    return sum(block_bytes_per_token(cfg, shape, counts, size, kind, document, block) for block in counts.blocks)


def largest_per_token(cfg: JobConfig, shape: Shape, counts: Counts, size: Dtypes, kind: Gpu, document: int) -> float:
    """The largest decoder layer's saved bytes per token (the one activation checkpointing recomputes at a time)."""
    if not counts.blocks:
        return layer_bytes_per_token(cfg, shape, counts, size, kind, document)
    return max(block_bytes_per_token(cfg, shape, counts, size, kind, document, block) for block in counts.blocks)


def workspace_per_token(cfg: JobConfig, shape: Shape, counts: Counts, size: Dtypes, kind: Gpu, document: int) -> float:
    """Per token, what one layer's backward adds at its widest beside the saved tensors counted (the activations,
    with checkpointing the largest layer's): its MLP's input gradients (of the product and its two factors, and the
    hidden-wide one), or its state layer's (state_memory.workspace_per_token). A layer's backward runs once the
    later layers' tensors are freed, or, with checkpointing, beside its own recomputed ones."""
    blocks = counts.blocks or _alike_blocks(shape)
    widest = [max([_mlp_workspace(shape, size, block),  # a state layer's comes once its MLP's tensors are freed
                   *(state_memory.workspace_per_token(m, document, size.compute) - _mlp_bytes_of(shape, size, block)
                     for m in block.mixers)])
              for block in blocks]
    if not counts.blocks:
        return max(widest)
    saved = [block_bytes_per_token(cfg, shape, counts, size, kind, document, block) for block in blocks]
    if cfg.model.gradient_checkpointing:
        return max(own + extra for own, extra in zip(saved, widest)) - max(saved)
    return max(0.0, *(extra - sum(saved[i + 1:]) for i, extra in enumerate(widest)))


def context_size(cfg: JobConfig) -> int:
    """The CP size whose ranks each hold 1/N of a row's tokens: dist.context_parallel, which the plan resolves
    before the memory formula runs (estimate.context_parallel_auto); DistConfig refuses it where it cannot run."""
    size = cfg.dist.context_parallel
    return size if isinstance(size, int) else 1


def _mlp_bytes_of(shape: Shape, size: Dtypes, block: Block) -> float:
    """A block's MLP: gate, up, silu(gate) and the product (or up and its activation, ungated); an MoE block's
    experts with its shared expert as the block holds it (Qwen3-Next's is shared_expert_intermediate_size wide)."""
    mlp = 2 * (block.mlp_linears - 1) * block.mlp * size.compute
    return _moe_bytes(shape, size, shared=mlp) if block.moe else mlp


def _alike_blocks(shape: Shape) -> tuple[Block, ...]:
    """The blocks of a family whose blocks are alike: dense, MoE (its shared experts as one MLP), or both."""
    dense = Block(attention=True, mlp=shape.intermediate)
    if not shape.experts:
        return (dense,)
    moe = Block(attention=True, mlp=shape.moe_intermediate * shape.shared_experts, moe=True)
    return (dense, moe) if shape.dense_layers else (moe,)


def _mlp_workspace(shape: Shape, size: Dtypes, block: Block) -> float:
    """A gated MLP's backward: its product's gradient, then both factors' (and the input's, hidden-wide); an MoE
    layer's routed pairs' alike, beside its shared experts'."""
    a = size.compute
    dense = (2 * block.mlp + shape.hidden) * a if block.mlp else 0.0
    if not block.moe:
        return dense
    return shape.experts_per_token * (2 * shape.moe_intermediate + shape.hidden) * (size.expert or a) + dense


def block_bytes_per_token(cfg: JobConfig, shape: Shape, counts: Counts, size: Dtypes, kind: Gpu, document: int,
                          block: Block) -> float:
    """One block of a family whose blocks differ: its norms and their outputs as its linear layers read them (one
    bf16 copy per layer under autocast over fp32 activations), attention's tensors where it has attention (and a
    gate's sigmoid and the output it multiplies), its state layers', its MLP's, its LoRA rank-r outputs."""
    h, a, full = shape.hidden, size.compute, not cfg.lora.enabled
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    readers = 3 * block.attention + sum(m.inputs for m in block.mixers) + 2 * bool(block.mlp or block.moe)
    total = norm_bytes(block.norm_inputs, size, trainable=full)
    total += readers * h * a if size.residual != a else block.norms * h * size.residual
    if block.attention:
        total += attention_memory.saved_in_layer(cfg.model.attn_implementation, shape, counts, kind, document, a,
                                                 size.residual, block.window, context_size(cfg))
        total += (2 * q + 2 * kv + 2 * q * block.gated_attention) * a
    total += sum(state_memory.saved_per_token(m, document, size, full) for m in block.mixers)
    total += _mlp_bytes_of(shape, size, block)
    if block.moe:
        total += _grouped_expert_lora_bytes(shape, counts, a, 1.0)
    if cfg.lora.enabled:
        total += block.lora_ranks * a + (block.lora_inputs * (a + 1) if cfg.lora.dropout > 0 else 0)
    return total


def layer_bytes_per_token(cfg: JobConfig, shape: Shape, counts: Counts, size: Dtypes, kind: Gpu,
                          document: int) -> float:
    """What autograd saves in one decoder block, per token: two RMSNorms, the linear layers' inputs (one bf16 copy
    per layer under autocast over fp32 activations), rotated q/k and v, attention's own, the MLP's
    intermediates, and LoRA's rank-r outputs (plus dropout's copies and masks). `document`: the longest document's
    tokens, whose attention scores a token may keep."""
    h, a = shape.hidden, size.compute
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    casts = size.residual != a  # each consumer of an fp32 activation saves its own bf16 copy
    full = not cfg.lora.enabled
    norms = norm_bytes(counts.norm_inputs_per_block or 2 * h, size, trainable=full)
    inputs = (3 + 2) * h * a if casts else 2 * h * size.residual
    attention = attention_memory.saved_per_token(cfg.model.attn_implementation, shape, counts, kind, document, a,
                                                 size.residual, context_size(cfg))
    attention += q * a  # o_proj's input
    total = norms + inputs + attention + (q + 2 * kv) * a + _mlp_bytes(shape, size)
    if cfg.lora.enabled:
        total += counts.lora_ranks_per_block * a + _grouped_expert_lora_bytes(shape, counts, a)
        if cfg.lora.dropout > 0:
            total += counts.lora_inputs_per_block * (a + 1)
    return total


def _grouped_expert_lora_bytes(shape: Shape, counts: Counts, a: int, moe_share: float | None = None) -> float:
    """Per token, averaged over the layers (or in one MoE layer: `moe_share` 1): lora.moe_adapter grouped saves each
    routed (token, expert) pair's rank-r product per adapted expert projection (its B copies are per layer:
    memory._expert_lora_layer_bytes)."""
    if not shape.experts:
        return 0.0
    if moe_share is None:
        moe_share = (shape.layers - shape.dense_layers) / shape.layers
    return moe_share * shape.experts_per_token * counts.lora_expert_ranks_per_block * a


def norm_bytes(hidden: int, size: Dtypes, trainable: bool) -> float:
    """RMSNorm in fp32: its fp32 input (for the square and the scaling) and, for a trainable weight, the
    normalised input the weight's gradient needs."""
    return hidden * (4 + (size.residual if trainable else 0))


def _mlp_bytes(shape: Shape, size: Dtypes) -> float:
    """Gated MLP (gate, up, SiLU(gate), product): four intermediates. MoE layers: top-k experts each with their
    gathered input and weighted output, shared experts, and the fp32 router logits; averaged over the layers."""
    dense = 4 * shape.intermediate * size.compute
    if not shape.experts:
        return dense
    moe = _moe_bytes(shape, size)
    return (shape.dense_layers * dense + (shape.layers - shape.dense_layers) * moe) / shape.layers


def _moe_bytes(shape: Shape, size: Dtypes, shared: float | None = None) -> float:
    """One MoE layer, per token: the routed pairs' intermediates, gathered inputs and weighted outputs, the shared
    experts' (`shared` bytes where known) and the router's fp32 logits."""
    a = size.compute
    expert = EXPERT_INTERMEDIATES.get(shape.family, 4) * shape.moe_intermediate
    routed = shape.experts_per_token * (expert + 2 * shape.hidden) * (size.expert or a)
    if shared is None:
        shared = 4 * shape.moe_intermediate * shape.shared_experts * a
    return routed + shared + shape.experts * 4

"""`trainyard estimate`, context parallelism (dist.context_parallel N, Ulysses: parallel/context_parallel.py): what a
rank holds of a micro-batch and what the all-to-alls around attention send.

Each rank of a CP group holds a contiguous 1/N of every row's tokens through the whole block, so every per-token
tensor of the memory formula (layers' saved tensors, the logits) counts tokens / N. Inside attention a rank holds
the whole row for heads / N: the same bytes per rank, and a token's scores still span its whole document (the
formula's `longest` is the whole document's). Around each layer's attention, q, k and v go out (sequence shard to
head shard) and the output comes back; backward sends their gradients the same way."""

from __future__ import annotations

import math
from dataclasses import replace

from trainyard.batch import MicroBatch
from trainyard.config import JobConfig
from trainyard.estimate.arch import Shape


CONTEXT_STRATEGIES = ("fsdp", "hsdp")
"""Where CP runs: it is carved out of their shard dimension, a DiLoCo site's included (DistConfig refuses it
elsewhere)."""


def context_size(cfg: JobConfig, strategy: str) -> int:
    """dist.context_parallel where the strategy carries it (fsdp, hsdp, diloco with either in a site), else 1 (one
    process runs no CP)."""
    size = cfg.dist.context_parallel
    assert size != "auto", "dist.context_parallel auto is resolved first (estimate.context_parallel_auto)"
    inner = cfg.diloco.inner if strategy == "diloco" else strategy
    return size if inner in CONTEXT_STRATEGIES else 1


def rank_batch(batch: MicroBatch, size: int) -> MicroBatch:
    """The part of a micro-batch one rank of a CP group holds through the block: its tokens / N (the collator pads
    the row to a multiple of N); the longest document stays whole (attention spans it)."""
    if size <= 1:
        return batch
    return replace(batch, tokens=math.ceil(batch.tokens / size))


def kv_heads_exchanged(shape: Shape, size: int) -> int:
    """KV heads after parallel/context_parallel.kv_repeats repeats them for the group to split evenly: the least
    multiple of kv_heads that `size` divides and that divides the query heads."""
    kv, heads = shape.kv_heads, shape.heads
    return next((kv * f for f in range(1, heads // kv + 1) if (kv * f) % size == 0 and heads % (kv * f) == 0), heads)


def exchanged_per_token(shape: Shape, size: int) -> int:
    """Elements per token of the exchange's tensors one way: q, k and v (repeated KV heads), then the output."""
    return shape.head_dim * (2 * shape.heads + 2 * kv_heads_exchanged(shape, size))


def exchange_buffer_bytes(shape: Shape, element: int, size: int, rank_tokens: int) -> float:
    """One layer's all-to-all buffers alive at once on a rank: q, k, v sent and received (its tokens, every head
    out; the whole row, heads / N in: the same count)."""
    if size <= 1:
        return 0.0
    kv = kv_heads_exchanged(shape, size)
    return 2.0 * rank_tokens * shape.head_dim * (shape.heads + 2 * kv) * element


def exchange_bytes_per_step(shape: Shape, element: int, size: int, rank_tokens: float, micro_batches: int,
                            recomputed: bool) -> float:
    """What one rank sends to the others of its CP group per optimizer step: in every layer, (N - 1) / N of its q,
    k, v and output, forward and again in backward (their gradients), and once more where activation
    checkpointing recomputes the forward; `rank_tokens`: the rank's tokens of a micro-batch."""
    if size <= 1:
        return 0.0
    passes = 3 if recomputed else 2
    per_layer = (size - 1) / size * rank_tokens * exchanged_per_token(shape, size) * element
    return passes * shape.layers * micro_batches * per_layer


def note(size: int, rank: MicroBatch) -> str:
    """What a rank holds of a micro-batch under CP, in words."""
    return (f"context parallel {size}: each rank holds {rank.tokens:,} tokens of the micro-batch through the block "
            f"and whole documents (up to {rank.longest:,} tokens) for heads / {size} inside attention")


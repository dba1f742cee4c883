"""`estimate --trace` under dist.context_parallel N: one CP rank's step. The job's refusals first (the family, its
padding-free rows, the attention inside the exchange, the heads), then rank 0's micro-batch as the collator cuts it
(data/collate.py: context_slice): its contiguous 1/N of the one padding-free row, each token's place in its document
kept, the whole row's document bounds beside it, and the logits of its targets only (the slice's last logit predicts
the first token of the next rank's). The exchange itself is the job's (parallel/context_parallel.py): its all-to-alls
run on the fake process group's CP dimension, so the rank holds whole documents for heads / N inside attention."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from trainyard import loss as loss_room
from trainyard.config import JobConfig
from trainyard.data.collate import document_bounds
from trainyard.model import attention
from trainyard.model.documents import model_inputs
from trainyard.parallel import context_parallel
from trainyard.parallel.parallelize import unwrap
from trainyard.train.trace_batch import documents, micro_batch_loss
from trainyard.train.trace_kernels import FUSED


def job_inner(cfg: JobConfig, model: torch.nn.Module, device: str) -> str:
    """The implementation the job wraps in its exchange on its `device`: on a GPU, auto is torch's varlen kernel
    where it keeps the family (attention.auto_choice without flash_attn, whose kernels the exchange does not run),
    else what auto or the user picks, which `check` may refuse."""
    if device == "cpu":
        return model.config._attn_implementation  # traced_attention's choice is the job's own here
    requested = cfg.model.attn_implementation
    if requested == "auto":
        dropout = getattr(model.config, "attention_dropout", 0.0) or 0.0
        return attention.auto_choice(attention.features(model, attention.packed_rows(cfg.data)), "cuda", False,
                                     dropout, cfg.model.gradient_checkpointing)
    return {"varlen": attention.VARLEN, "flex_attention": attention.FLEX}.get(requested, requested)


def check(cfg: JobConfig, model: torch.nn.Module, size: int, shard: int, device: str) -> None:
    """Refuse what `train` refuses for this CP size (context_parallel.check, with the job's implementation), then
    give the model the kernel the trace runs inside the exchange: trainyard's varlen as itself, torch's varlen
    kernel as the fused one that stands for it (output and log-sum-exp kept, no scores)."""
    inner = job_inner(cfg, model, device)
    model.config._attn_implementation = inner
    context_parallel.check(model, size, shard, cfg.data, cfg.where("dist.context_parallel"))
    model.config._attn_implementation = FUSED if inner == attention.TORCH_VARLEN else inner


def attention_of(model: torch.nn.Module) -> str:
    """The attention the model runs: under CP, the one inside the exchange."""
    found = context_parallel.group_of(model)
    return model.config._attn_implementation if found is None else found.inner


def rank_loss(model: torch.nn.Module, cfg: JobConfig) -> torch.Tensor:
    """The micro-batch's loss on this rank: its CP slice of the one padding-free row (micro_batch_size documents of
    data.max_length, or the token budget's), or the whole micro-batch without context parallelism."""
    found = context_parallel.group_of(model)
    if found is None:
        return micro_batch_loss(model, cfg)
    lengths = documents(cfg)
    total = sum(lengths)
    length = -(-total // found.size)
    start, end = found.rank * length, (found.rank + 1) * length
    with unset_fake_temporarily():  # real: the rank's positions and the row's bounds are read on the host
        restarting = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(length * found.size - total)])
        targets_next = torch.cat([restarting[1:total] != 0, torch.zeros(length * found.size - total + 1, dtype=bool)])
        keep = torch.nonzero(targets_next[start:end]).squeeze(1)
        batch = {"input_ids": torch.zeros((1, length), dtype=torch.long),
                 "position_ids": restarting[start:end].unsqueeze(0), **document_bounds(lengths, length * found.size)}
        inputs = model_inputs(batch, torch.device("cpu"), unwrap(model).config)
    wanted = torch.zeros(len(keep), dtype=torch.long)
    return loss_room.kept_positions_loss(model, inputs, keep, wanted, cfg.train.loss_chunk_tokens)


def note(cfg: JobConfig, size: int) -> str:
    """What the traced rank holds, in words."""
    total = sum(documents(cfg))
    return (f"context parallel {size}: rank 0 holds {-(-total // size):,} of the row's {total:,} tokens through the "
            f"block and whole documents for heads / {size} inside attention; its all-to-alls run around every "
            "layer's attention")

"""The micro-batches `estimate --trace` runs a step of, as the job collates them where the data is not read:
micro_batch_size documents of data.max_length each, or under train.micro_batch_tokens N one padding-free row of
N tokens (documents of data.max_length, the last cut short) in as many micro-batches as the estimate plans."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from trainyard import loss as loss_room
from trainyard.batch import accumulation_steps
from trainyard.config import JobConfig
from trainyard.estimate.timing import Lengths, micro_batches_per_step


def micro_batches(cfg: JobConfig, world: int) -> int:
    """Micro-batches per step: the accumulation, or under a token budget the estimate's count for rows of
    data.max_length (estimate.timing.micro_batches_per_step), which the collectives per step follow."""
    return micro_batches_per_step(cfg, accumulation_steps(cfg, world), float(cfg.data.max_length))[0]


def documents(cfg: JobConfig) -> list[int]:
    """Each traced row's documents' tokens; under a token budget the one row's (the memory's micro-batch: N tokens,
    or one row where N is shorter)."""
    length = cfg.data.max_length
    if not isinstance(cfg.train.micro_batch_tokens, int):
        return [length] * cfg.train.micro_batch_size
    full, left = divmod(Lengths().largest_micro_batch(cfg).tokens, length)
    return [length] * full + ([left] if left else [])


def micro_batch_loss(model: torch.nn.Module, cfg: JobConfig) -> torch.Tensor:
    """The loss of one full micro-batch (every position a target but each document's last), as
    loss.token_loss_sum computes it (logits at target positions only, in chunks of train.loss_chunk_tokens): rows of
    one document each, or one padding-free row whose positions restart at each document. Its positions are given as
    an index, not found from the labels, which fake tensors do not hold."""
    found = documents(cfg)
    one_row = isinstance(cfg.train.micro_batch_tokens, int)
    rows, length = (1, sum(found)) if one_row else (len(found), found[0])
    tokens = torch.zeros((rows, length), dtype=torch.long)
    with unset_fake_temporarily():  # real: varlen and the state layers read the documents from them on the host
        restarting = torch.cat([torch.arange(n) for n in found])
        positions = restarting.unsqueeze(0) if one_row else torch.arange(length).expand(rows, length)
        keep = torch.nonzero(restarting[1:] != 0).squeeze(1) if one_row else torch.arange(length - 1)
    targets = torch.zeros(rows * len(keep), dtype=torch.long)
    return loss_room.kept_positions_loss(model, {"input_ids": tokens, "position_ids": positions}, keep, targets,
                                         cfg.train.loss_chunk_tokens)

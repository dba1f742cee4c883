"""The training loss: cross-entropy summed over target tokens, with logits computed only where a label follows.
Training and evaluation both use it; it imports only data's IGNORE_INDEX.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import modeling_utils

from trainyard.data import IGNORE_INDEX
from trainyard.parallel.parallelize import unwrap

_MASK_KEEP = hasattr(modeling_utils, "slice_logits_to_keep")  # boolean logits_to_keep masks (transformers 5)


def token_loss_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over target tokens, and how many there were; `batch` on the host.

    Logits are computed only where a label follows (transformers' `logits_to_keep`): the vocabulary
    projection and the fp32 softmax over prompt and padding positions were a quarter of a LoRA step
    on CPU, and their [tokens, vocab] fp32 logits the largest activation. For a padding-free row the
    target positions are found on the host, so the device never waits on a mask's count."""
    inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    targets = batch["labels"][:, 1:]
    is_target = targets != IGNORE_INDEX
    if not _keeps_logits(model):
        logits = model(**inputs, use_cache=False).logits[:, :-1].float()
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.reshape(-1).to(device),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return loss, is_target.sum().to(device)
    if is_target.size(0) == 1:  # the logit at t predicts the label at t + 1
        keep: torch.Tensor = is_target[0].nonzero().squeeze(1)
    else:
        keep = F.pad(is_target, (0, 1), value=False)
    logits = model(**inputs, use_cache=False, logits_to_keep=keep.to(device)).logits.float()
    wanted = targets[is_target].to(device)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), wanted, reduction="sum")
    return loss, is_target.sum().to(device)


def _keeps_logits(model: torch.nn.Module) -> bool:
    """Models whose forward takes `logits_to_keep`, in a transformers that accepts position tensors and
    boolean masks for it."""
    net = unwrap(model)
    net = net.get_base_model() if hasattr(net, "get_base_model") else net  # PEFT's wrapper passes it on
    return _MASK_KEEP and "logits_to_keep" in inspect.signature(type(net).forward).parameters

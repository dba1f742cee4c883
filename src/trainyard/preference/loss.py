"""Preference losses over pairs of documents: each completion's log-probability summed over its target tokens, the
reference's (the same model, LoRA adapters off), and the pairwise loss TRL defines for dpo.loss.

A micro-batch holds its pairs as documents back to back (position_ids restart at each; see data/preference.py):
the documents that have target tokens, in order, are chosen, rejected, chosen, rejected... No padding is computed
and no pair is padded to its partner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trainyard.config import DpoConfig
from trainyard.config.preference import REFERENCE_FREE
from trainyard.data import IGNORE_INDEX
from trainyard.loss import add_product, chunkable_head, final_softcap, head_computes, keeps_logits
from trainyard.model.documents import model_inputs
from trainyard.parallel.context_parallel import summed_over_slices
from trainyard.parallel.parallelize import unwrap

STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
         "logps/rejected")
"""TRL's figures, each averaged over the pairs (summed per pair here, divided by the pairs when reported)."""


def target_documents(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """For each target token (labels[:, 1:] not ignored, row-major), the number of its document among the batch's
    documents that have targets: 0, 0, ..., 1, ... A document starts where the position does not go up by one. A
    context-parallel slice names its labels' documents in the whole row (collate.context_slice)."""
    if "label_documents" in batch:
        return batch["label_documents"][:, 1:][batch["labels"][:, 1:] != IGNORE_INDEX]
    positions = batch["position_ids"]
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    document = starts.flatten().cumsum(0).view_as(positions) - 1
    owners = document[:, 1:][batch["labels"][:, 1:] != IGNORE_INDEX]
    return torch.unique_consecutive(owners, return_inverse=True)[1]


def count_pairs(batch: dict[str, torch.Tensor]) -> int:
    """The pairs of the batch; a context-parallel slice counts those it owns (`owned_pairs`)."""
    if "documents_ending" in batch:
        return int(owned_pairs(batch).sum())
    documents = target_documents(batch)
    return (int(documents[-1]) + 1) // 2 if documents.numel() else 0


def owned_pairs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per pair of a context-parallel slice's row, whether this rank holds its rejected reply's last target: every
    rank of the group computes each pair's loss, the owner alone adds it in (and its figures), so each counts once."""
    return batch["documents_ending"][1::2]


def _all_pairs(batch: dict[str, torch.Tensor]) -> int:
    return batch["documents_ending"].numel() // 2 if "documents_ending" in batch else count_pairs(batch)


def target_logps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, chunk_tokens: int | None = None
) -> torch.Tensor:
    """log p(label) of every target token, row-major, fp32; logits only where a label follows, and (as the SFT
    loss, train.loss_chunk_tokens) never more than one chunk of them at a time, forward or backward."""
    inputs = model_inputs(batch, device, unwrap(model).config)
    targets = batch["labels"][:, 1:]
    is_target = targets != IGNORE_INDEX
    wanted = targets[is_target].to(device)
    if keeps_logits(model):
        keep = is_target[0].nonzero().squeeze(1) if is_target.size(0) == 1 else F.pad(is_target, (0, 1), value=False)
        head = chunkable_head(model, chunk_tokens)
        if head is not None:
            softcap = final_softcap(model)

            def logps(flat: torch.Tensor, chunk: int) -> torch.Tensor:
                return _ChunkedTargetLogps.apply(flat, head.weight, head.bias, wanted, chunk, softcap)

            with head_computes(head, chunk_tokens, logps) as result:
                model(**inputs, use_cache=False, logits_to_keep=keep.to(device))
            return result["value"]
        logits = model(**inputs, use_cache=False, logits_to_keep=keep.to(device)).logits
        logits = logits.reshape(-1, logits.size(-1)).float()
    else:
        logits = model(**inputs, use_cache=False).logits[:, :-1][is_target.to(device)].float()
    return torch.log_softmax(logits, dim=-1).gather(1, wanted.unsqueeze(1)).squeeze(1)


def _chunk_logits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits of a chunk (soft-capped where the family caps them), and tanh of the cap for its derivative. The
    product runs in the operands' dtype (`_operands`), never autocast's: the backward runs outside autocast."""
    with torch.autocast(rows.device.type, enabled=False):
        logits = F.linear(rows, weight, bias).float()
    if not softcap:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, capped


def _operands(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias in the forward's autocast dtype (one copy a pass, as autocast would make), or as
    they are without autocast."""
    if dtype is None:
        return weight, bias
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


class _ChunkedTargetLogps(torch.autograd.Function):
    """log softmax(hidden @ weight.T + bias)[target] per row, one chunk of rows at a time. The backward computes
    each chunk's logits again rather than keep them: DPO's gradient per token depends on every token of its pair,
    so it cannot be taken during the forward as the SFT loss's is. Both passes compute the logits in the dtype
    autocast gave the forward (its log-sum-exp is the backward's too), and the head's gradient is summed in the
    head's own dtype, as the SFT loss sums it (estimate: head_gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
        chunk: int, softcap: float | None,
    ) -> torch.Tensor:
        ctx.dtype = _autocast_dtype(hidden.device)
        compute_weight, compute_bias = _operands(weight, bias, ctx.dtype)
        logps = torch.empty(hidden.size(0), dtype=torch.float32, device=hidden.device)
        norms = torch.empty_like(logps)
        for start in range(0, hidden.size(0), chunk):
            rows = hidden[start : start + chunk].to(ctx.dtype or hidden.dtype)
            logits, _ = _chunk_logits(rows, compute_weight, compute_bias, softcap)
            norms[start : start + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets[start : start + chunk].unsqueeze(1)).squeeze(1)
            logps[start : start + chunk] = picked - norms[start : start + chunk]
        ctx.save_for_backward(hidden, weight, bias, targets, norms)
        ctx.chunk, ctx.softcap = chunk, softcap
        return logps

    @staticmethod
    def backward(ctx: Any, grad_logps: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, norms = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        compute_weight, compute_bias = _operands(weight, bias, ctx.dtype)
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight) if needs_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if needs_bias and bias is not None else None
        for start in range(0, hidden.size(0), ctx.chunk):
            rows = hidden[start : start + ctx.chunk].to(ctx.dtype or hidden.dtype)
            scale = grad_logps[start : start + ctx.chunk].float().unsqueeze(1)
            logits, capped = _chunk_logits(rows, compute_weight, compute_bias, ctx.softcap)
            grad = logits.sub_(norms[start : start + ctx.chunk].unsqueeze(1)).exp_().mul_(-scale)  # -p * upstream
            grad.scatter_add_(1, targets[start : start + ctx.chunk].unsqueeze(1), scale)  # + one-hot * upstream
            if capped is not None:
                grad *= 1 - capped.square()
            grad = grad.to(rows.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + ctx.chunk] = grad @ compute_weight.to(rows.dtype)
            if grad_weight is not None:
                add_product(grad_weight, grad.T, rows)
            if grad_bias is not None:
                grad_bias += grad.float().sum(dim=0)
        return (
            grad_hidden, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None,
        )


@dataclass
class PairLogps:
    """Per pair: summed log-probabilities of the chosen and rejected completions, and their token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def pair_logps(token_logps: torch.Tensor, batch: dict[str, torch.Tensor], model: torch.nn.Module | None = None
               ) -> PairLogps:
    """The batch's pairs from its target tokens' log-probabilities; a context-parallel slice (collate.context_slice)
    holds part of each pair: the pair's sums are its CP group's (`model`'s), on every rank of the group."""
    pairs = _all_pairs(batch)
    index = target_documents(batch).to(token_logps.device)
    sums = token_logps.new_zeros(2 * pairs).index_add(0, index, token_logps)
    counts = torch.bincount(index, minlength=2 * pairs).to(token_logps.dtype)
    if "label_documents" in batch:
        assert model is not None, "a context-parallel slice's pairs are summed over the model's CP group"
        sums, counts = summed_over_slices(model, torch.stack([sums, counts])).unbind(0)
    return PairLogps(sums[0::2], sums[1::2], counts[0::2], counts[1::2])


def dpo_loss(
    cfg: DpoConfig, policy: PairLogps, reference: PairLogps | None, chosen_nll: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair losses and the per-pair figures of STATS (a [pairs, 6] tensor), as TRL computes them: DPOTrainer
    for sigmoid, hinge, ipo (log-ratios per completion token) and robust; label smoothing of sigmoid as conservative
    DPO (TRL's CPOTrainer's, as its DPOTrainer had it); CPOTrainer for simpo (cpo_alpha 0: without its NLL term) and
    ORPOTrainer for orpo, whose `chosen_nll` is the micro-batch's mean cross-entropy of the chosen sequences."""
    beta = cfg.beta
    if cfg.loss in REFERENCE_FREE:
        chosen, rejected = policy.chosen / policy.chosen_tokens, policy.rejected / policy.rejected_tokens
        if cfg.loss == "simpo":
            losses = -F.logsigmoid(beta * (chosen - rejected - cfg.simpo_gamma / beta))
        else:
            assert chosen_nll is not None
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            losses = chosen_nll - beta * F.logsigmoid(log_odds)
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
        logps = (chosen.detach(), rejected.detach())
    else:
        assert reference is not None
        chosen_ratio, rejected_ratio = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        delta = chosen_ratio - rejected_ratio
        smoothing = cfg.label_smoothing
        if cfg.loss == "sigmoid":
            losses = -(1 - smoothing) * F.logsigmoid(beta * delta) - smoothing * F.logsigmoid(-beta * delta)
        elif cfg.loss == "robust":
            losses = (-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)) / (
                1 - 2 * smoothing)
        elif cfg.loss == "hinge":
            losses = torch.relu(1 - beta * delta)
        else:  # ipo
            per_token = chosen_ratio / policy.chosen_tokens - rejected_ratio / policy.rejected_tokens
            losses = (per_token - 1 / (2 * beta)) ** 2
        chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
        logps = (policy.chosen.detach(), policy.rejected.detach())
    stats = torch.stack([chosen_rewards, rejected_rewards, chosen_rewards - rejected_rewards,
                         (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype), *logps], dim=1)
    return losses, stats


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation near 0 (as TRL's ORPOTrainer computes it)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def with_chosen_prompts(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO's targets: the labels with every token of each chosen document (its prompt too, all but its first)
    trained, as TRL's ORPOTrainer takes the chosen sequence's cross-entropy; and where those chosen documents lie."""
    positions, labels = batch["position_ids"], batch["labels"]
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    document = starts.flatten().cumsum(0).view_as(positions) - 1
    chosen = torch.unique(document[labels != IGNORE_INDEX])[0::2]  # documents with targets: chosen, rejected, ...
    in_chosen = torch.isin(document, chosen) & ~starts
    return torch.where(in_chosen, batch["input_ids"], labels), in_chosen


def _orpo_logps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, chunk_tokens: int | None
) -> tuple[PairLogps, torch.Tensor]:
    """The pairs' log-probabilities of their replies and the mean cross-entropy of the chosen sequences, from one
    forward."""
    labels, in_chosen = with_chosen_prompts(batch)
    token_logps = target_logps(model, {**batch, "labels": labels}, device, chunk_tokens)
    targets = labels[:, 1:] != IGNORE_INDEX
    reply = (batch["labels"][:, 1:] != IGNORE_INDEX)[targets].to(device)
    chosen_nll = -token_logps[in_chosen[:, 1:][targets].to(device)].mean()
    return pair_logps(token_logps[reply], batch), chosen_nll


def pair_loss_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, cfg: DpoConfig,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss of the batch's pairs and its STATS summed over them; `batch` on the host. The reference is
    the batch's `ref_logps` (full fine-tuning: computed before training, reference.py), or a forward without
    gradients through the same (wrapped) model with its adapters off. ORPO's cross-entropy term counts once per
    pair: summed over the micro-batch and divided by the step's pairs, it is TRL's mean over equal micro-batches."""
    if cfg.loss == "orpo":
        policy, chosen_nll = _orpo_logps(model, batch, device, chunk_tokens)
        losses, stats = dpo_loss(cfg, policy, None, chosen_nll)
        return losses.sum(), stats.sum(dim=0)
    reference = None
    if cfg.loss not in REFERENCE_FREE and "ref_logps" in batch:
        stored = batch["ref_logps"].to(device=device, dtype=torch.float32)
        reference = PairLogps(stored[:, 0], stored[:, 1], stored.new_zeros(0), stored.new_zeros(0))
    elif cfg.loss not in REFERENCE_FREE:
        from trainyard.model.lora import adapters_off  # LoRA's reference (PEFT): full fine-tuning stored its own

        with torch.no_grad(), adapters_off(model):
            reference = pair_logps(target_logps(model, batch, device, chunk_tokens), batch, model)
    policy = pair_logps(target_logps(model, batch, device, chunk_tokens), batch, model)
    losses, stats = dpo_loss(cfg, policy, reference)
    if "documents_ending" in batch:
        owned = owned_pairs(batch).to(losses.device)
        losses, stats = losses[owned], stats[owned]
    return losses.sum(), stats.sum(dim=0)

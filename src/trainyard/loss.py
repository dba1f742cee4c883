"""The training loss: cross-entropy summed over target tokens, with logits computed only where a label follows,
and never for more than one chunk of tokens at a time. Training and evaluation both use it; it imports only data's
IGNORE_INDEX, parallel's unwrap and what the model's attention takes (model.documents).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import modeling_utils

from trainyard.data import IGNORE_INDEX
from trainyard.dist import is_fsdp
from trainyard.model.documents import model_inputs
from trainyard.parallel.parallelize import unwrap

_MASK_KEEP = hasattr(modeling_utils, "slice_logits_to_keep")  # boolean logits_to_keep masks (transformers 5)
LOSS_CHUNK_BYTES = 256 * 2**20
"""fp32 logits of one chunk, by default (train.loss_chunk_tokens: None)."""
CHUNKED_FAMILIES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2",
    "glm4_moe", "deepseek_v3", "gpt_oss",
})
"""Families whose forward makes logits as lm_head(hidden), then at most final_logit_softcapping: the chunked loss
computes exactly that. Another family's head may scale or bias its logits in its own way: it keeps full logits."""


def token_loss_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device, chunk_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over target tokens, and how many there were; `batch` on the host.

    Logits are computed only where a label follows (transformers' `logits_to_keep`): the vocabulary
    projection and the fp32 softmax over prompt and padding positions were a quarter of a LoRA step
    on CPU. The kept positions then go through the head `chunk_tokens` at a time (train.loss_chunk_tokens),
    inside the model's forward, where FSDP2 holds the head's gathered weight. For a padding-free row the
    target positions are found on the host, so the device never waits on a mask's count."""
    inputs = model_inputs(batch, device, unwrap(model).config)
    targets = batch["labels"][:, 1:]
    is_target = targets != IGNORE_INDEX
    if not keeps_logits(model):
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
    loss = kept_positions_loss(model, inputs, keep.to(device), targets[is_target].to(device), chunk_tokens)
    return loss, is_target.sum().to(device)


def kept_positions_loss(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], keep: torch.Tensor, wanted: torch.Tensor,
    chunk_tokens: int | None,
) -> torch.Tensor:
    """The summed loss of the `keep` positions (transformers' logits_to_keep) against `wanted`, chunked where the
    family allows. The estimate's trace runs this too, with fake tensors."""
    head = chunkable_head(model, chunk_tokens)
    if head is not None:
        softcap = final_softcap(model)

        def loss(flat: torch.Tensor, chunk: int) -> torch.Tensor:
            return chunked_cross_entropy(flat, head.weight, head.bias, wanted, chunk, softcap)

        with head_computes(head, chunk_tokens, loss) as result:
            model(**inputs, use_cache=False, logits_to_keep=keep)
        return result["value"]
    logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), wanted, reduction="sum")


def keeps_logits(model: torch.nn.Module) -> bool:
    """Models whose forward takes `logits_to_keep`, in a transformers that accepts position tensors and
    boolean masks for it."""
    net = _base(model)
    return _MASK_KEEP and "logits_to_keep" in inspect.signature(type(net).forward).parameters


def _base(model: torch.nn.Module) -> torch.nn.Module:
    net = unwrap(model)
    return net.get_base_model() if hasattr(net, "get_base_model") else net  # PEFT's wrapper passes it on


def chunkable_head(model: torch.nn.Module, chunk_tokens: int | None) -> torch.nn.Linear | None:
    """The plain linear head of a family the chunked loss computes exactly; None keeps full logits (chunking off,
    another family, or a head PEFT wraps with its own adapter)."""
    net = _base(model)
    head = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None
    family = getattr(getattr(net, "config", None), "model_type", None)
    if chunk_tokens == 0 or family not in CHUNKED_FAMILIES or _plain_type(head) is not torch.nn.Linear:
        return None
    return head


def _plain_type(module: torch.nn.Module | None) -> type:
    """A module's class, under FSDP2's wrapper class (an untied head is a unit of its own: parallelize)."""
    return type(module).__bases__[-1] if module is not None and is_fsdp(module) else type(module)


def final_softcap(model: torch.nn.Module) -> float | None:
    return getattr(_base(model).config, "final_logit_softcapping", None)


@contextlib.contextmanager
def head_computes(
    head: torch.nn.Linear, chunk_tokens: int | None,
    compute: Callable[[torch.Tensor, int], torch.Tensor],
) -> Iterator[dict[str, torch.Tensor]]:
    """For one forward, the head returns a placeholder and `compute(hidden states, chunk)` of the hidden states it
    is given goes to result["value"] (the SFT loss here, DPO's log-probabilities in preference/loss.py). Zeros as
    the placeholder: a family's final soft-capping leaves them zero, and nothing reads them."""
    result: dict[str, torch.Tensor] = {}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        chunk = chunk_tokens or max(1, LOSS_CHUNK_BYTES // (4 * head.out_features))
        result["value"] = compute(hidden.reshape(-1, hidden.size(-1)), chunk)
        return hidden.new_zeros((*hidden.shape[:-1], 1))

    head.forward = forward  # type: ignore[method-assign]  # an instance attribute: FSDP/DDP hooks stay as they are
    try:
        yield result
    finally:
        del head.forward


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, chunk: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """sum over rows of cross_entropy(softcap(hidden @ weight.T + bias), targets), fp32 logits, one chunk of rows at
    a time. Each chunk's gradients are computed as it goes (Liger's fused linear cross-entropy does the same on
    GPUs), so its logits are freed before the next chunk's exist and none wait for the backward. A trainable head's
    gradient is summed in the head's own dtype (each chunk's product accumulated in fp32 by the matmul): it is the
    gradient backward hands on, with no fp32 copy of an unsharded [V, H] beside it (estimate: head_gradient)."""
    grads = torch.is_grad_enabled()
    needs = (grads and hidden.requires_grad, grads and weight.requires_grad,
             grads and bias is not None and bias.requires_grad)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk, softcap, needs)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
        chunk: int, softcap: float | None, needs: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        grad_weight = torch.zeros_like(weight) if needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if needs[2] and bias is not None else None
        for start in range(0, hidden.size(0), chunk):
            rows, wanted = hidden[start : start + chunk], targets[start : start + chunk]
            logits = F.linear(rows, weight, bias).float()
            capped = torch.tanh(logits / softcap) if softcap else None
            if capped is not None:
                logits = capped * softcap
            counted = wanted != IGNORE_INDEX
            picked = wanted.clamp(min=0).unsqueeze(1)
            norm = torch.logsumexp(logits, dim=-1, keepdim=True)
            loss += ((norm.squeeze(1) - logits.gather(1, picked).squeeze(1)) * counted).sum()
            if not any(needs):
                continue
            grad = logits.sub_(norm).exp_()  # d loss / d logits = softmax - one-hot (counted rows), in place
            grad.scatter_add_(1, picked, -torch.ones_like(picked, dtype=grad.dtype))
            grad *= counted.unsqueeze(1)
            if capped is not None:
                grad *= 1 - capped.square()
            del capped
            grad = grad.to(rows.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = grad @ weight.to(rows.dtype)
            if grad_weight is not None:
                add_product(grad_weight, grad.T, rows)
            if grad_bias is not None:
                grad_bias += grad.float().sum(dim=0)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_loss.float()  # scaled in place: a second vocabulary-sized gradient would double its memory
        return (
            None if grad_hidden is None else grad_hidden.mul_(scale.to(grad_hidden.dtype)),
            None if grad_weight is None else grad_weight.mul_(scale),
            None if grad_bias is None else grad_bias.mul_(scale).to(ctx.dtypes[1]),
            None, None, None, None,
        )


def add_product(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """total += left @ right, the product accumulated in fp32 by the matmul and added in total's dtype: in place
    where the dtypes agree, else (fp32 masters under autocast) through one product in the compute dtype."""
    if total.dtype == left.dtype == right.dtype:
        total.addmm_(left, right)
    else:
        total += left @ right

"""Padding-free rows through torch's own varlen attention (`torch.nn.attention.varlen.varlen_attn`: FlashAttention-2
kernels inside torch, nothing extra to install), registered with transformers as attention.TORCH_VARLEN.

The contract is the kernel's: the row's tokens as [T, H, D], the documents as `cu_seq_lens` (int32 [N + 1]) and the
longest one as an int, causal attention within each document, a sliding window as `window_size` (left, 0), GQA through
`enable_gqa` where the installed torch has it (repeated KV heads where not). The bounds come from the collator, made on
the host (data/collate.py: document_bounds), and reach the attention as transformers' flash kwargs (`cu_seq_lens_q`,
`max_length_q`, see documents.model_inputs): no layer reads the device. Off CUDA the same contract runs through
`reference` (sdpa per document), which the tests check against every family's eager attention; tests/gpu checks the
kernel against it. What the kernel cannot keep (soft-capping, sinks, attention dropout) and what has no bounds
(padded rows, generation) goes to trainyard's varlen (attention.py).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from trainyard.model import attention

def _kernel() -> Callable[..., torch.Tensor] | None:
    """torch's varlen_attn where this torch has it (2.10 and later)."""
    try:
        return importlib.import_module("torch.nn.attention.varlen").varlen_attn
    except (ImportError, AttributeError):
        return None


KERNEL = _kernel()
GQA = KERNEL is not None and "enable_gqa" in inspect.signature(KERNEL).parameters
"""Whether the kernel takes fewer KV heads than query heads itself; where not, the KV heads are repeated."""


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor,
    max_q: int, max_k: int, *, scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """varlen_attn's contract in sdpa, one document at a time ([T, H, D] in and out): key j is seen by query i of
    the same document when i - left <= j <= i + right (-1: unbounded)."""
    left, right = window_size
    parts = []
    for a, b in zip(cu_seq_q.tolist(), cu_seq_q.tolist()[1:]):
        q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))
        i = torch.arange(b - a, device=query.device)[:, None]
        j = torch.arange(b - a, device=query.device)[None, :]
        keep = torch.ones(b - a, b - a, dtype=torch.bool, device=query.device)
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        out = F.scaled_dot_product_attention(q, k, v, keep, scale=scale, enable_gqa=enable_gqa)
        parts.append(out.transpose(0, 1))
    return torch.cat(parts)


_on_device: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)


def _device_bounds(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host's cu_seq_lens on the device, copied once per forward (every layer gets the same tensor)."""
    global _on_device
    if _on_device[0] is not host:
        _on_device = (host, host.to(device, torch.int32, non_blocking=True))
    assert _on_device[1] is not None
    return _on_device[1]


HALF = (torch.float16, torch.bfloat16)
"""The kernel's dtypes: an fp32 job's attention stays on trainyard's varlen."""


def half_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half precision the kernel computes the layer in: the operands' own, or autocast's where it is on. A full
    fine-tune at bf16-mixed keeps fp32 hidden states, so rotary embeddings turn autocast's bf16 queries and keys
    back to fp32; sdpa under autocast computes in bf16 all the same (it is on autocast's lower-precision list), and
    so does the kernel. None: an fp32 job without autocast."""
    if query.dtype in HALF:
        return query.dtype
    device = query.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in HALF:
        return torch.get_autocast_dtype(device)
    return None


def kept(query: torch.Tensor, kwargs: dict[str, Any], training: bool) -> bool:
    """Whether the kernel computes what the layer asks: no soft-capping, no sinks, no dropout while training, and
    (on CUDA) half-precision operands or autocast."""
    dropout = kwargs.get("dropout", 0.0) if training else 0.0
    plain = kwargs.get("softcap") is None and kwargs.get("s_aux") is None and not dropout
    return plain and (not query.is_cuda or half_dtype(query) is not None)


def torch_varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One padding-free row, [1, H, T, D] in, [1, T, H, D] out like transformers' sdpa, through the kernel (CUDA) or
    its reference (elsewhere); anything else through trainyard's varlen."""
    bounds = kwargs.get("cu_seq_lens_q")
    given = attention_mask is None or attention.documents_in_kwargs(attention_mask)
    one_row = query.shape[0] == 1 and query.shape[2] == key.shape[2]  # no cache: a training or scoring forward
    if bounds is None or not given or not one_row or not kept(query, kwargs, module.training):
        return attention.varlen_attention(module, query, key, value, attention_mask, **kwargs)
    attention.refuse_unknown(module, {k: v for k, v in kwargs.items() if k not in ("position_ids", "is_causal")})
    window = kwargs.get("sliding_window")
    longest = int(kwargs["max_length_q"])
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, H, D], as transformers' flash
    if query.is_cuda:
        q, k, v = (x.to(half_dtype(query)) for x in (q, k, v))  # type: ignore[arg-type]  (kept: not None)
    if not GQA and k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    width = v.shape[-1]  # MLA's values are narrower than its queries: padded to one head size, as for flash kernels
    v = F.pad(v, (0, q.shape[-1] - width)) if width < q.shape[-1] else v
    cu = _device_bounds(bounds, query.device) if query.is_cuda else bounds
    run = KERNEL if query.is_cuda and KERNEL is not None else reference
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    out = run(q, k, v, cu, cu, longest, longest, scale=kwargs.get("scaling"),
              window_size=(window - 1, 0) if window else (-1, 0), **gqa)
    return out[None, ..., :width], None


AttentionInterface.register(attention.TORCH_VARLEN, torch_varlen_attention)
AttentionMaskInterface.register(attention.TORCH_VARLEN, attention.varlen_mask)

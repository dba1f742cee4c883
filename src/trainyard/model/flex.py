"""flex_attention for the families whose scores soft-capping or sinks change (Gemma 2, gpt-oss), registered with
transformers as attention.FLEX: on a GPU their documents would otherwise run the family's eager attention, which
holds [heads, L, L] scores per layer (8 GiB in bf16 for gpt-oss-20b at 8k tokens, and activation checkpointing
saves them for every layer). flex computes the same function block by block and holds no L x L tensor.

* Soft-capping is a score_mod (cap * tanh(score / cap), after the scaling, as the families' eager code does).
* A sink adds exp(sink) to each query's softmax denominator and nothing to its output, so
  out = flex_out * exp(lse) / (exp(lse) + exp(sink)) = flex_out * sigmoid(lse - sink), computed in fp32 from flex's
  fp32 log-sum-exp (transformers' own flex path rounds that to bf16 first, and refuses sinks on a CPU).
* Padding-free and packed rows: a block mask per document read from position_ids (a new document wherever the
  position does not go up by one, attention.document_bounds' rule), causal and within the layer's window, so
  gpt-oss's documents stay apart although its own mask ignores position_ids. Padded rows: the block mask of the
  family's own mask function and the 2-D attention_mask. Generation's decode steps run trainyard's varlen.

On CUDA flex_attention runs compiled (transformers' compiled wrapper). Elsewhere it runs eagerly: that computes
dense scores and has no backward on a CPU, so training there never chooses it; it serves to check the function
(tests/unit/model/test_flex.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.flex_attention import compile_friendly_flex_attention
from transformers.masking_utils import (
    AttentionMaskInterface, add_offsets_to_mask_function, and_masks, causal_mask_function, padding_mask_function,
    prepare_padding_mask, sdpa_mask,
)

from trainyard.errors import ModelError
from trainyard.model import attention


def flex_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """[B, H, T, D] in, [B, T, H, D] out like transformers' attention functions."""
    position_ids = kwargs.pop("position_ids", None)
    kwargs.pop("is_causal", None)
    attention.refuse_unknown(module, kwargs)
    if kwargs.get("dropout", 0.0) > 0:
        raise ModelError(
            f"{type(module).__name__} has attention dropout, which flex_attention does not apply",
            fix="set model.attn_implementation: varlen, or the model config's attention_dropout to 0",
        )
    if not isinstance(attention_mask, BlockMask):
        if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
            return attention.varlen_attention(module, query, key, value, attention_mask, position_ids=position_ids,
                                              **kwargs)
        attention_mask = _documents_mask(position_ids, query.shape[0], kwargs.get("sliding_window"))
    out = _flex(query, key, value, attention_mask, kwargs.get("scaling"), kwargs.get("softcap"),
                kwargs.get("s_aux"), module.training)
    return out.transpose(1, 2).contiguous(), None


def _flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, scaling: float | None,
    softcap: float | None, sinks: torch.Tensor | None, training: bool,
) -> torch.Tensor:
    """The family's attention over the block mask, [B, H, T, D]."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and query.shape[1] & (query.shape[1] - 1):  # flex's grouped heads want a power of two
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    options: dict[str, Any] = dict(
        score_mod=None if softcap is None else _softcapped(softcap), block_mask=block_mask, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1], return_aux=AuxRequest(lse=True) if sinks is not None else None,
    )
    if query.device.type == "cuda":
        out = compile_friendly_flex_attention(query, key, value, training=training, **options)
    else:
        out = flex_attention(query, key, value, **options)
    if sinks is None:
        return out
    out, aux = out
    kept = torch.sigmoid(aux.lse - sinks.float()[None, :, None])  # each query's softmax mass not on its sink
    return (out.float() * kept[..., None]).to(query.dtype)


def _softcapped(cap: float) -> Callable[..., torch.Tensor]:
    def softcap(score: torch.Tensor, batch: Any, head: Any, q: Any, kv: Any) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return softcap


_last_masks: tuple[torch.Tensor | None, dict[tuple[int, int | None], BlockMask]] = (None, {})


def _documents_mask(position_ids: torch.Tensor, batch: int, window: int | None) -> BlockMask:
    """Every layer of one forward gets the same position_ids tensor: one block mask per window for all of them."""
    global _last_masks
    if _last_masks[0] is not position_ids:
        _last_masks = (position_ids, {})
    masks = _last_masks[1]
    if (batch, window) not in masks:
        masks[batch, window] = documents_block_mask(position_ids, batch, window)
    return masks[batch, window]


def documents_block_mask(position_ids: torch.Tensor, batch: int, window: int | None) -> BlockMask:
    """Each query sees the keys of its own document, itself and before, within the window (transformers' rule: key >
    query - window). position_ids [1, T] stand for every row."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    documents = starts.cumsum(-1).expand(batch, -1)

    def same_document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        keep = (documents[b, q] == documents[b, kv]) & (kv <= q)
        return keep if window is None else keep & (kv > q - window)

    length = position_ids.shape[-1]
    return create_block_mask(same_document, B=batch, H=None, Q_LEN=length, KV_LEN=length, device=position_ids.device,
                             _compile=position_ids.device.type == "cuda")


def flex_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu", **kwargs: Any,
) -> BlockMask | torch.Tensor | None:
    """No mask for padding-free rows (the attention reads the documents from position_ids); over a 2-D
    attention_mask, the block mask of the family's mask function and the padding (transformers' flex mask, compiled
    on CUDA only); sdpa's mask for generation's decode steps (varlen runs them)."""
    if attention_mask is None:
        return None
    if q_length != kv_length:
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         device=device, **kwargs)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    keep = add_offsets_to_mask_function(and_masks(mask_function, padding_mask_function(padding)), q_offset, kv_offset)
    return create_block_mask(keep, B=batch_size, H=None, Q_LEN=q_length, KV_LEN=kv_length, device=device,
                             _compile=torch.device(device).type == "cuda")


AttentionInterface.register(attention.FLEX, flex_attention_forward)
AttentionMaskInterface.register(attention.FLEX, flex_mask)

"""Attention over padding-free batches: several documents in one row, each attending only to itself.

A padding-free micro-batch (data.padding_free) is one row of concatenated documents whose
position_ids restart at 0 at each document, with no attention_mask. transformers' own backends
isolate the documents from those position_ids, each in its own way: flash_attention_2/3 run
varlen kernels (no mask at all); sdpa and eager build a dense [B, 1, T, T] mask in which most
entries are masked and still computed; flex_attention builds a block mask (compiled kernels).

`varlen` (registered with transformers as "trainyard_varlen") is the CPU-friendly varlen path: it
cuts the row at the document boundaries and runs causal sdpa on each document, so no T x T mask
is built and no cross-document score is computed. Measured on SmolLM2-135M + LoRA (4 documents
of 60-420 tokens, bf16 on one CPU core) a step took 2.2 s, against 2.7 s with sdpa's dense mask
and 6.2 s padded (benchmarks/RESULTS.md). Batches with an attention_mask (padded rows,
generation) go to transformers' sdpa unchanged.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from trainyard.errors import ModelError

VARLEN = "trainyard_varlen"
FLASH = ("flash_attention_2", "flash_attention_3")


def resolve(name: str, where: str | None = None) -> str:
    """The transformers attention implementation for model.attn_implementation.

    auto: flash-attention varlen on a GPU where the flash_attn package is installed, else `varlen`."""
    if name == "auto":
        return "flash_attention_2" if torch.cuda.is_available() and _has_flash_attn() else VARLEN
    if name == "varlen":
        return VARLEN
    if name in FLASH and not (torch.cuda.is_available() and _has_flash_attn()):
        raise ModelError(
            f"model.attn_implementation: {name} needs a CUDA GPU and the flash_attn package"
            + (f" ({where})" if where else ""),
            fix="install flash-attn on a GPU machine, or use auto, varlen or sdpa",
        )
    return name


def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def document_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) of each document: a new one starts wherever the position does not
    go up by one (transformers' own packed-sequence rule)."""
    rows = []
    for positions in position_ids.tolist():
        starts = [0] + [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
        rows.append(list(zip(starts, starts[1:] + [len(positions)])))
    return rows


_last_bounds: tuple[torch.Tensor | None, list[list[tuple[int, int]]]] = (None, [])


def _bounds_of(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Every layer of one forward gets the same position_ids tensor: read it to the host once."""
    global _last_bounds
    if _last_bounds[0] is not position_ids:
        _last_bounds = (position_ids, document_bounds(position_ids))
    return _last_bounds[1]


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal sdpa per document of each row; [B, H, T, D] in, [B, T, H, D] out like transformers' sdpa."""
    position_ids = kwargs.pop("position_ids", None)
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    rows = []
    bounds = _bounds_of(position_ids)
    if len(bounds) == 1:  # position_ids [1, T] stand for every row
        bounds = bounds * query.shape[0]
    for row, spans in enumerate(bounds):
        parts = [
            _causal_attention(module, query[row : row + 1, :, a:b], key[row : row + 1, :, a:b],
                              value[row : row + 1, :, a:b], kwargs)
            for a, b in spans
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return (rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)), None


SHORT_DOCUMENT = 1024
"""Up to this many tokens a CPU document's attention runs as two bf16 matmuls around an fp32 softmax:
torch's CPU flash kernel is 1.4-2.8x slower there in bf16 (60-420 tokens, benchmarks/RESULTS.md). Its
[heads, L, L] scores stay small (36 MB at 9 heads and 1024 tokens in fp32)."""


def _causal_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    """One document's causal attention, [1, L, H, D] out."""
    length = query.shape[2]
    if query.device.type != "cpu" or length > SHORT_DOCUMENT or kwargs.get("dropout", 0.0) > 0:
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)[0]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    future = torch.ones(length, length, dtype=torch.bool, device=query.device).triu(1)
    weights = scores.masked_fill_(future, float("-inf")).softmax(dim=-1).to(value.dtype)
    return torch.matmul(weights, value).transpose(1, 2)


def varlen_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask for padding-free rows (the attention reads the documents from position_ids);
    sdpa's mask where there is a 2-D attention_mask (padding, generation)."""
    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(VARLEN, varlen_attention)
AttentionMaskInterface.register(VARLEN, varlen_mask)

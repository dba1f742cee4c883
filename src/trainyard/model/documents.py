"""Where a padding-free row's documents come from: the bounds the collator made on the host (data/collate.py:
document_bounds), passed to the model as transformers' flash kwargs so that no layer reads the device; or, for a
forward without them (evaluation's generation, a caller's plain forward), position_ids read back from the device.
"""

from __future__ import annotations

from typing import Any

import torch

HOST_BOUNDS: set[str] = set()
"""Implementations that read a padding-free row's documents from the collator's host bounds (model_inputs): each
adds its name where it registers with transformers (attention.py: trainyard's and torch's varlen; the
context-parallel exchange, which wraps them)."""
HOST_LOOP = "trainyard: the attention loops over the micro-batch's documents on the host"
"""The reason the host-bounds attentions and state layers (state_layers.py) are left out of compiled graphs: how
parallel.compile tells the expected graph break apart."""
DOCUMENT_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
CONTEXT_PARALLEL_FAMILIES = ("llama", "qwen3", "mistral", "gemma2", "gpt_oss", "qwen3_moe", "glm4_moe")
"""Families whose documents, split over a context-parallel group, give one process's loss and every gradient
(tests/dist/test_context_parallel.py; the MoE ones with expert parallelism, tests/dist/
test_context_expert_parallel.py): sliding windows (mistral, gemma2, gpt_oss), soft-capping (gemma2) and sinks
(gpt_oss) included. parallel.context_parallel runs them; the estimate proposes CP for them only."""


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device, config: Any) -> dict[str, Any]:
    """What the model (of HF `config`) takes from a collated micro-batch: its ids, mask and positions on the device;
    for a padding-free row under an implementation of HOST_BOUNDS, the documents' bounds made on the host
    (transformers' flash kwargs: they reach every attention call unchanged) and an empty 4-D mask: transformers
    returns a 4-D mask as it is, so it does not look for packed documents in position_ids (an `.all()` on the device
    per forward). A model that returns its router logits reads the mask as [B, T] for its load-balancing loss: it
    gets no mask, and transformers' look."""
    inputs: dict[str, Any] = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")
                              if k in batch}
    if "cu_seq_lens" in batch and "attention_mask" not in batch and config._attn_implementation in HOST_BOUNDS:
        longest = int(batch["max_length"])
        inputs.update(dict(zip(DOCUMENT_KWARGS, (batch["cu_seq_lens"],) * 2 + (longest,) * 2)))
        if not getattr(config, "output_router_logits", False):
            inputs["attention_mask"] = torch.empty(1, 1, 0, 0, dtype=torch.bool, device=device)
    return inputs


def documents_in_kwargs(attention_mask: torch.Tensor | None) -> bool:
    """Whether the mask is model_inputs' empty one: the documents are in the flash kwargs."""
    return attention_mask is not None and attention_mask.dim() == 4 and attention_mask.numel() == 0


def document_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) of each document: a new one starts wherever the position does not
    go up by one (transformers' own packed-sequence rule)."""
    rows = []
    for positions in position_ids.tolist():
        starts = [0] + [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
        rows.append(list(zip(starts, starts[1:] + [len(positions)])))
    return rows

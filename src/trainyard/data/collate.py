"""Rows -> a padded micro-batch of tensors, padded only to the longest row in it."""

from __future__ import annotations

from typing import Any

import torch

from trainyard.data.formats import IGNORE_INDEX

Row = dict[str, Any]


def _right_padded(sequences: list[list[int]], length: int, value: int) -> torch.Tensor:
    batch = torch.full((len(sequences), length), value, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        batch[i, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    return batch


def _blocks(seq_lens: list[int], length: int) -> list[int]:
    """Document lengths of a packed row, padding counted as one more block of its own."""
    padding = length - sum(seq_lens)
    return list(seq_lens) + ([padding] if padding else [])


def packed_attention(
    seq_lens_per_row: list[list[int]], length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [B, L], additive mask [B, 1, L, L]) isolating the documents of packed rows.

    Position ids restarting per document are not enough on their own: transformers' sdpa and
    eager attention still let a token see earlier documents. The mask is block-diagonal causal:
    0 where a token may attend, torch.finfo(float32).min elsewhere. Padding forms its own block,
    so no query row is fully masked (that gives NaN in some kernels).

    Backends: sdpa accepts this float mask (or the bool form `mask == 0`); eager needs the float
    form. Cast to a bf16/fp16 model's dtype, the minimum becomes -inf, which is harmless here
    because every query keeps at least its own position. On GPU, flash-attention varlen
    (cu_seqlens from seq_lens) or flex_attention with a document mask do the same without an
    L x L tensor per row.
    """
    positions = torch.zeros(len(seq_lens_per_row), length, dtype=torch.long)
    document = torch.zeros(len(seq_lens_per_row), length, dtype=torch.long)
    for i, seq_lens in enumerate(seq_lens_per_row):
        start = 0
        for number, size in enumerate(_blocks(seq_lens, length)):
            positions[i, start : start + size] = torch.arange(size)
            document[i, start : start + size] = number
            start += size
    same_document = document[:, :, None] == document[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = same_document & causal
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return positions, mask[:, None]


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids, labels, attention_mask and real_tokens; packed rows add position_ids.

    Unpacked rows get a 2D 0/1 attention_mask. Rows with `seq_lens` (packed) get the 4D
    block-diagonal mask of `packed_attention` instead. real_tokens counts non-padding tokens,
    the figure tokens/s should report.
    """
    input_ids = [row["input_ids"] for row in rows]
    length = max(len(ids) for ids in input_ids)
    batch = {
        "input_ids": _right_padded(input_ids, length, pad_id),
        "labels": _right_padded([row["labels"] for row in rows], length, IGNORE_INDEX),
        "real_tokens": torch.tensor(sum(len(ids) for ids in input_ids), dtype=torch.long),
    }
    if "seq_lens" in rows[0]:
        positions, mask = packed_attention([row["seq_lens"] for row in rows], length)
        batch["position_ids"] = positions
        batch["attention_mask"] = mask
    else:
        batch["attention_mask"] = _right_padded([[1] * len(ids) for ids in input_ids], length, 0)
    return batch

"""Rows -> one micro-batch of tensors: padding-free (one row of documents) or padded to the longest row."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainyard.data.formats import IGNORE_INDEX

Row = dict[str, Any]


def _right_padded(sequences: list[list[int]], length: int, value: int) -> torch.Tensor:
    batch = torch.full((len(sequences), length), value, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        batch[i, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    return batch


def _documents(row: Row) -> list[int]:
    """Lengths of the documents in a row: a packed row lists them in seq_lens, any other row is one."""
    return list(row.get("seq_lens") or [len(row["input_ids"])])


def _restarting_positions(lengths: list[int], total: int) -> list[int]:
    """0, 1, ... per document; what is left up to `total` (padding) restarts once more, so it is
    a block of its own and no query is left without a key."""
    positions = [i for size in lengths for i in range(size)]
    return positions + list(range(total - len(positions)))


def document_bounds(lengths: list[int], total: int) -> dict[str, torch.Tensor]:
    """The row's documents as varlen kernels take them, made here on the host so that no layer reads them back
    from the device: `cu_seq_lens` (int32 [documents + 1], each document's start, then the row's end) and
    `max_length` (0-d, the longest). What is left up to `total` (padding) is one more document, as in
    _restarting_positions."""
    lengths = [size for size in lengths if size] + ([total - sum(lengths)] if total > sum(lengths) else [])
    starts = [0]
    for size in lengths:
        starts.append(starts[-1] + size)
    return {
        "cu_seq_lens": torch.tensor(starts, dtype=torch.int32),
        "max_length": torch.tensor(max(lengths, default=0), dtype=torch.long),
    }


def padding_free_batch(rows: list[Row]) -> dict[str, torch.Tensor]:
    """All rows' documents concatenated into one row [1, T] with restarting position_ids and no
    attention_mask: no padding is computed, and transformers' attention backends (or trainyard's
    varlen, see attention.py) keep each document to itself; the documents' bounds come along
    (document_bounds). Every document's first label is IGNORE_INDEX, so no token learns to predict
    across a boundary."""
    input_ids = [token for row in rows for token in row["input_ids"]]
    lengths = [size for row in rows for size in _documents(row)]
    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "labels": torch.tensor([[label for row in rows for label in row["labels"]]], dtype=torch.long),
        "position_ids": torch.tensor([_restarting_positions(lengths, len(input_ids))], dtype=torch.long),
        "real_tokens": torch.tensor(len(input_ids), dtype=torch.long),
        **document_bounds(lengths, len(input_ids)),
    }


def padded_batch(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows right-padded to the longest. Plain rows get a 2-D 0/1 attention_mask; packed rows
    (with seq_lens) get restarting position_ids and no mask, so transformers isolates their
    documents from the positions."""
    input_ids = [row["input_ids"] for row in rows]
    length = max(len(ids) for ids in input_ids)
    batch = {
        "input_ids": _right_padded(input_ids, length, pad_id),
        "labels": _right_padded([row["labels"] for row in rows], length, IGNORE_INDEX),
        "real_tokens": torch.tensor(sum(len(ids) for ids in input_ids), dtype=torch.long),
    }
    if "seq_lens" in rows[0]:
        positions = [_restarting_positions(_documents(row), length) for row in rows]
        batch["position_ids"] = torch.tensor(positions, dtype=torch.long)
    else:
        batch["attention_mask"] = _right_padded([[1] * len(ids) for ids in input_ids], length, 0)
    return batch


def context_slice(batch: dict[str, torch.Tensor], rank: int, size: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Context parallelism: this rank's contiguous 1/`size` of a padding-free row, padded at the end only to a
    multiple of `size`. position_ids stay each token's place in its document (rotary and the documents are the
    whole row's); the labels carry one more than the tokens, the label the slice's last logit predicts, so the
    loss's shift (labels[:, 1:]) finds each target on the one rank holding the token before it, and a count of
    targets over the CP group counts each once. real_tokens: the slice's tokens that are not padding. The document
    bounds are the whole padded row's: the attention inside the exchange sees every token of the row. A pair's two
    documents may lie on several ranks, so each label names its document among the whole row's that have targets
    (`label_documents`, -1 elsewhere; DPO sums each over the group), and `documents_ending` says, per document, whether
    its last target is this rank's: a pair counts on the one rank holding its rejected reply's last target."""
    total = batch["input_ids"].size(1)
    length = -(-total // size)
    padding = length * size - total
    start, end = rank * length, (rank + 1) * length
    positions = batch["position_ids"][0].tolist()
    lengths = batch["cu_seq_lens"].diff().tolist()
    labels = F.pad(batch["labels"], (0, padding + 1), value=IGNORE_INDEX)
    owners = _label_documents(batch["labels"][0], lengths)
    is_target = owners >= 0
    last = torch.zeros(int(owners.max()) + 1, dtype=torch.long).scatter_reduce_(
        0, owners[is_target], torch.arange(total)[is_target], "amax")
    return {
        "input_ids": F.pad(batch["input_ids"], (0, padding), value=pad_id)[:, start:end],
        "labels": labels[:, start : end + 1],
        "position_ids": torch.tensor([positions + list(range(padding))], dtype=torch.long)[:, start:end],
        "real_tokens": torch.tensor(max(0, min(end, total) - start), dtype=torch.long),
        "label_documents": F.pad(owners, (0, padding + 1), value=-1)[start : end + 1].unsqueeze(0),
        "documents_ending": (last > start) & (last <= end),
        **document_bounds(lengths, total + padding),
        **{name: batch[name] for name in ("ref_logps",) if name in batch},
    }


def _label_documents(labels: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each label's document, numbered among the row's documents that have targets; -1 where it is no target."""
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    is_target = labels != IGNORE_INDEX
    trained = torch.zeros(len(lengths), dtype=torch.long).index_add_(0, document, is_target.long()) > 0
    return torch.where(is_target, (trained.cumsum(0) - 1)[document], -1)


def collate(
    rows: list[Row], pad_id: int, padding_free: bool = True, context: tuple[int, int] = (0, 1)
) -> dict[str, torch.Tensor]:
    """input_ids, labels, real_tokens (non-padding tokens, the figure tokens/s reports), and
    position_ids or attention_mask as the layout needs; a preference pair's reference log-probabilities
    (`ref_logps`, one [chosen, rejected] per row) when the rows have them. `context`: (this rank's place in its
    context-parallel group, the group's size): a padding-free row is cut to the rank's slice."""
    batch = padding_free_batch(rows) if padding_free else padded_batch(rows, pad_id)
    if "ref_logps" in rows[0]:
        batch["ref_logps"] = torch.tensor([row["ref_logps"] for row in rows], dtype=torch.float64)
    return context_slice(batch, *context, pad_id) if context[1] > 1 else batch

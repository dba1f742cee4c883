"""Micro-batches in sampler order: the one loader interface the trainer iterates."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch

from trainyard.data.collate import collate
from trainyard.data.sampler import ResumableSampler

COLUMNS = ("input_ids", "labels", "seq_lens")


def micro_batches(
    dataset: Any,
    sampler: ResumableSampler,
    micro_batch_size: int,
    pad_id: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """Collated micro-batches, forever.

    Nothing is read ahead: after a micro-batch is yielded, `sampler.state_dict()` is exactly the
    point to resume from, so a checkpoint taken between steps replays no row and skips none.
    """
    columns = [name for name in COLUMNS if name in dataset.column_names]
    rows_of = dataset.select_columns(columns)
    indices = iter(sampler)
    while True:
        picked = list(islice(indices, micro_batch_size))
        fetched = rows_of[picked]
        rows = [{name: fetched[name][i] for name in columns} for i in range(len(picked))]
        yield collate(rows, pad_id)

"""MFU's model FLOPs under context parallelism: the ranks of a CP group each hold a slice of the row, whose pieces
of a document attend over the whole document inside the exchange; their FLOPs sum to the whole row's."""

from __future__ import annotations

import pytest

from trainyard.data.collate import collate
from trainyard.data.formats import IGNORE_INDEX
from trainyard.hardware import FlopShape, training_flops
from trainyard.train.votes import document_lengths, micro_batch_flops

SHAPE = FlopShape(active=10, trainable=10, heads=4, qk_head_dim=16, v_head_dim=16, windows=(None, None))
DOCUMENTS = (20, 13, 28)
"""61 tokens: two slices of 31 (the second document crosses the boundary), the last padded by one."""


def rows() -> list[dict[str, list[int]]]:
    return [{"input_ids": [5] * n, "labels": [IGNORE_INDEX] + [5] * (n - 1)} for n in DOCUMENTS]


def test_a_cp_groups_flops_are_the_whole_rows_not_the_slices_pieces() -> None:
    slices = [collate(rows(), 0, True, (rank, 2)) for rank in range(2)]
    whole = training_flops(SHAPE, [*DOCUMENTS, 1])  # the padding to a multiple of 2: a block of its own
    assert sum(micro_batch_flops(SHAPE, batch, 2) for batch in slices) == pytest.approx(whole, rel=1e-12)
    pieces = training_flops(SHAPE, [20, 11]) + training_flops(SHAPE, [2, 28, 1])  # what each slice's positions show
    assert whole - pieces > 1e-3 * whole  # attention over whole documents: what the pieces miss
    assert max(document_lengths(slices[1])) == 28


def test_without_cp_a_micro_batch_counts_its_own_documents() -> None:
    batch = collate(rows(), 0, True)
    assert micro_batch_flops(SHAPE, batch, 1) == training_flops(SHAPE, list(DOCUMENTS))

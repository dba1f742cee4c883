"""evaluate() attends each document of a packed eval row on its own, as the training forward does."""

from __future__ import annotations

from types import SimpleNamespace

import datasets
import pytest
import torch

from tests.unit.model.families import build, documents
from trainyard.dist import DistInfo
from trainyard.evaluate import evaluate
from trainyard.model import attention

CPU = torch.device("cpu")


def _document_row(ids: torch.Tensor) -> dict[str, list[int]]:
    """A document as prepare writes it: its first label is -100, so no target crosses into it from a neighbour."""
    return {"input_ids": ids.tolist(), "labels": [-100] + ids[1:].tolist()}


def _packed_row(docs: list[torch.Tensor]) -> dict[str, list[int]]:
    rows = [_document_row(ids) for ids in docs]
    return {"input_ids": sum((r["input_ids"] for r in rows), []), "labels": sum((r["labels"] for r in rows), []),
            "seq_lens": [len(ids) for ids in docs]}


def _eval_loss(model: torch.nn.Module, rows: list[dict[str, list[int]]], padding_free: bool) -> dict[str, float]:
    return evaluate(model, datasets.Dataset.from_list(rows), subset_size=len(rows), seed=0, batch_size=2,
                    info=DistInfo(0, 1, 0, 1, CPU, None), tokenizer=SimpleNamespace(pad_token_id=0),
                    padding_free=padding_free)


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding-free", "padded"])
def test_a_packed_eval_row_scores_as_its_documents_do_alone(padding_free: bool) -> None:
    model = build("llama", attention.VARLEN)
    docs = documents()
    alone = _eval_loss(model, [_document_row(ids) for ids in docs], padding_free=False)
    packed = _eval_loss(model, [_packed_row(docs[:2]), _packed_row(docs[2:])], padding_free)
    assert packed["eval_tokens"] == alone["eval_tokens"] == sum(len(ids) - 1 for ids in docs)
    assert packed["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-6)

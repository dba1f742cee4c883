"""evaluate() attends each document of a packed eval row on its own, as the training forward does."""

from __future__ import annotations

from types import SimpleNamespace

import datasets
import pytest
import torch

from tests.unit.model.families import build, documents
from trainyard.dist import DistInfo
from trainyard.evaluate import evaluate, generate_answers
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


def test_generation_hands_the_head_contiguous_rows_one_position_per_prompt() -> None:
    """The first forward of a generation keeps the last position of each prompt: a strided slice, which torch's CPU
    linear multiplies by copying the head's weight once per prompt (seconds for a real vocabulary). The head must
    see contiguous rows, one position each, and the answers must be the plain model's."""
    model = build("llama", "sdpa").eval()
    prompts = [ids.tolist() for ids in documents()[:3]]
    seen: list[tuple[bool, tuple[int, ...]]] = []
    model.get_output_embeddings().register_forward_hook(
        lambda _module, args, _out: seen.append((args[0].is_contiguous(), tuple(args[0].shape))))
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None, decode=lambda ids, **_: " ".join(map(str, ids)))
    answers = generate_answers(model, prompts, tokenizer, max_new_tokens=3, lockstep=False, device=CPU)

    assert seen == [(True, (len(prompts), 1, model.config.hidden_size))] * 3
    width = max(map(len, prompts))
    padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([[width - len(p)] for p in prompts])).long()
    plain = model.generate(input_ids=padded, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert answers == [" ".join(map(str, row.tolist())) for row in plain[:, width:]]

"""Collate and loader: padding, packed-document isolation in a real model, resumable batches."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.modeling_flash_attention_utils import _is_packed_sequence

from trainyard.config.data import DataConfig
from trainyard.data import ResumableSampler, collate, micro_batches
from trainyard.model.attention import FLASH, VARLEN, document_bounds, varlen_attention
from trainyard.model.collation import one_row

PAD = 0


def test_rows_are_right_padded_to_the_longest():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [-100]}]
    batch = collate(rows, pad_id=PAD, padding_free=False)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, PAD, PAD]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["real_tokens"].item() == 4 and batch["real_tokens"].dim() == 0
    assert "position_ids" not in batch


def test_padding_free_rows_are_one_row_of_documents():
    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, -100, 5], "seq_lens": [3, 2]},
        {"input_ids": [6, 7], "labels": [-100, 7]},
    ]
    batch = collate(rows, pad_id=PAD)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert "attention_mask" not in batch and batch["real_tokens"].item() == 7
    # the documents' bounds for varlen kernels, made here: the same documents the position_ids give
    assert batch["cu_seq_lens"].tolist() == [0, 3, 5, 7] and batch["cu_seq_lens"].dtype == torch.int32
    assert int(batch["max_length"]) == 3
    assert document_bounds(batch["position_ids"]) == [[(0, 3), (3, 5), (5, 7)]]


def test_padded_packed_rows_get_restarting_positions_and_padding_a_block_of_its_own():
    rows = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, -100, 5], "seq_lens": [3, 2]},
        {"input_ids": [6, 7], "labels": [-100, 7], "seq_lens": [2]},
    ]
    batch = collate(rows, pad_id=PAD, padding_free=False)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert "attention_mask" not in batch and batch["real_tokens"].item() == 7
    assert document_bounds(batch["position_ids"]) == [[(0, 3), (3, 5)], [(0, 2), (2, 5)]]


def tiny_llama(attention: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation(attention)
    return model


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding-free", "padded"])
@pytest.mark.parametrize("attention", [VARLEN, "sdpa", "eager"])
def test_packed_documents_match_separate_runs(attention, padding_free):
    model = tiny_llama(attention)
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 64, (n,), generator=generator).tolist() for n in (5, 9, 7)]
    packed_ids = [token for doc in docs for token in doc]
    rows = [
        {"input_ids": packed_ids, "labels": packed_ids, "seq_lens": [5, 9, 7]},
        {"input_ids": docs[1], "labels": docs[1], "seq_lens": [9]},  # padded: 9 of 21
    ]
    batch = collate(rows, pad_id=PAD, padding_free=padding_free)
    inputs = {key: batch[key] for key in ("input_ids", "position_ids")}
    with torch.no_grad():
        packed = model(**inputs, use_cache=False).logits
        alone = [model(input_ids=torch.tensor([doc])).logits[0] for doc in docs]
        # the comparison can fail: without restarting positions the later documents see the earlier ones
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits
    if padding_free:
        torch.testing.assert_close(packed[0], torch.cat(alone + [alone[1]]), atol=1e-5, rtol=0)
    else:
        torch.testing.assert_close(packed[0], torch.cat(alone), atol=1e-5, rtol=0)
        torch.testing.assert_close(packed[1, :9], alone[1], atol=1e-5, rtol=0)
    assert (leaky[0, 5:14] - alone[1]).abs().max() > 1e-3


FLASH_PROBE = "test_varlen_decision_probe"
_varlen_seen: list[bool] = []


def _flash_probe(module, query, key, value, attention_mask, **kwargs):
    """What transformers' flash path decides on the position_ids it is given (_flash_attention_forward): varlen over
    the documents only where `_is_packed_sequence` holds, else causal over each whole row. Computes with varlen."""
    _varlen_seen.append(bool(_is_packed_sequence(kwargs.get("position_ids"), query.shape[0])))
    return varlen_attention(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(FLASH_PROBE, _flash_probe)


@pytest.mark.parametrize("implementation", FLASH)
def test_packed_padded_rows_reach_a_flash_kernel_as_one_row_of_their_documents(implementation):
    """data.packing with data.padding_free false: a flash kernel gets the micro-batch as one padding-free row,
    which its varlen path splits into the documents; the padded rows it got before ran causal across them."""
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, -100, 9], "seq_lens": [3, 2]},
        {"input_ids": [10, 11, 12, 13], "labels": [-100, 11, -100, 13], "seq_lens": [2, 2]},
    ]
    packed_padded = DataConfig(packing=True, padding_free=False)
    model = tiny_llama(FLASH_PROBE)
    seen = {}
    for layout, flat in (("chosen", one_row(implementation, packed_padded)), ("padded", False)):
        batch = collate(rows, pad_id=PAD, padding_free=flat)
        _varlen_seen.clear()
        with torch.no_grad():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        seen[layout] = (tuple(batch["input_ids"].shape), list(_varlen_seen))
    assert seen["chosen"] == ((1, 9), [True, True])
    assert seen["padded"] == ((2, 5), [False, False])  # the check can fail: what every flash layer ran before
    assert not one_row("sdpa", packed_padded) and not one_row(VARLEN, packed_padded)  # their masks isolate rows
    assert not one_row(implementation, DataConfig(packing=False, padding_free=False))  # one document per row


def dataset_of(count: int) -> datasets.Dataset:
    rows = [list(range(1, 2 + i % 5)) for i in range(count)]
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})


def test_micro_batches_follow_the_sampler_order():
    data = dataset_of(12)
    sampler = ResumableSampler(12, seed=0, rank=0, world_size=1)
    order = ResumableSampler(12, seed=0, rank=0, world_size=1).epoch_order(0)
    batch = next(micro_batches(data, sampler, micro_batch_size=4, pad_id=PAD, padding_free=False))
    expected = [data[i]["input_ids"] for i in order[:4]]
    assert [row[row != PAD].tolist() for row in batch["input_ids"]] == expected
    assert batch["input_ids"].shape[1] == max(len(ids) for ids in expected)
    assert sampler.state_dict() == {"epoch": 0, "position": 4}


def test_resumed_loader_yields_the_same_batches_as_an_uninterrupted_one():
    data = dataset_of(10)

    def loader(sampler):
        return micro_batches(data, sampler, micro_batch_size=3, pad_id=PAD)

    uninterrupted = loader(ResumableSampler(10, seed=5, rank=0, world_size=1))
    expected = [next(uninterrupted)["input_ids"].tolist() for _ in range(7)]
    first_sampler = ResumableSampler(10, seed=5, rank=0, world_size=1)
    first = loader(first_sampler)
    got = [next(first)["input_ids"].tolist() for _ in range(4)]
    resumed_sampler = ResumableSampler(10, seed=5, rank=0, world_size=1)
    resumed_sampler.load_state_dict(first_sampler.state_dict())
    resumed = loader(resumed_sampler)
    got += [next(resumed)["input_ids"].tolist() for _ in range(3)]
    assert got == expected


@pytest.mark.parametrize("size", [2, 3])
def test_context_parallel_slices_put_back_together_are_the_row_padded_to_a_multiple_of_the_group(size: int):
    """Each rank's contiguous slice of the padding-free row, padding only at the end; position_ids stay each
    token's place in its document; labels carry the next slice's first label, so the loss's shift finds every target
    on exactly one rank."""
    rows = [{"input_ids": list(range(10, 17)), "labels": [-100, *range(11, 17)]},
            {"input_ids": list(range(20, 24)), "labels": [-100, 21, 22, 23]}]
    whole = collate(rows, pad_id=PAD)
    slices = [collate(rows, pad_id=PAD, context=(rank, size)) for rank in range(size)]
    length = -(-11 // size)
    assert all(s["input_ids"].shape == (1, length) for s in slices)
    glued = {name: torch.cat([s[name] for s in slices], dim=1)[0].tolist() for name in ("input_ids", "position_ids")}
    padding = length * size - 11
    assert glued["input_ids"] == whole["input_ids"][0].tolist() + [PAD] * padding
    assert glued["position_ids"] == [*range(7), *range(4), *range(padding)]
    targets = [t for s in slices for t in s["labels"][0, 1:].tolist()]
    assert targets == whole["labels"][0, 1:].tolist() + [-100] * (padding + 1)  # the last token predicts nothing
    assert sum(int((s["labels"][:, 1:] != -100).sum()) for s in slices) == 9
    assert sum(int(s["real_tokens"]) for s in slices) == 11
    for s in slices:  # each rank's attention sees the whole padded row, its padding a document of its own
        assert s["cu_seq_lens"].tolist() == [0, 7, 11] + ([11 + padding] if padding else [])
        assert int(s["max_length"]) == 7


def test_a_context_parallel_slice_of_pairs_names_each_labels_document_in_the_whole_row_and_keeps_the_reference():
    """DPO under CP: a pair's reply may start on one rank and end on the next, so each target of a slice names its
    document among the whole row's that have targets (the second pair's chosen reply crosses the halves here), and
    says which documents end on it, so a pair counts once; full fine-tuning's stored reference log-probabilities
    ride along."""
    rows = [{"input_ids": list(range(10, 17)), "labels": [-100, -100, 12, 13, -100, 15, 16], "seq_lens": [4, 3],
             "ref_logps": [-1.5, -2.5]},
            {"input_ids": list(range(30, 41)), "labels": [-100, -100, 32, 33, 34, 35, -100, -100, 38, 39, 40],
             "seq_lens": [6, 5], "ref_logps": [-3.5, -4.5]}]
    slices = [collate(rows, pad_id=PAD, context=(rank, 2)) for rank in range(2)]
    owners = [s["label_documents"][0, 1:][s["labels"][0, 1:] != -100].tolist() for s in slices]
    assert owners == [[0, 0, 1, 1, 2], [2, 2, 2, 3, 3, 3]], owners  # the second chosen reply: tokens 9-12
    ending = [s["documents_ending"].tolist() for s in slices]  # each pair owned by one rank: its rejected's end
    assert ending == [[True, True, False, False], [False, False, True, True]], ending
    assert [s["label_documents"].shape for s in slices] == [(1, 10), (1, 10)]  # as the labels: one past the slice
    for s in slices:
        assert s["ref_logps"].tolist() == [[-1.5, -2.5], [-3.5, -4.5]]

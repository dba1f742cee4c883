"""Padding-free rows on the device: the attention `auto` picks there keeps every document to itself."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.gpu.conftest import Device
from trainyard.data import collate
from trainyard.model import attention

pytestmark = pytest.mark.gpu


def tiny_llama(device: Device, hidden: int, max_positions: int) -> LlamaForCausalLM:
    """A bf16 Llama on the device, under the attention auto chooses there."""
    target = torch.device("cuda" if device.cuda else "cpu")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    model = LlamaForCausalLM(config).to(target, torch.bfloat16).eval()
    model.config._attn_implementation = attention.choose("auto", model, target, training=False)
    return model


def documents(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def together(model: LlamaForCausalLM, docs: list[list[int]], positions: bool = True) -> torch.Tensor:
    """The documents' logits as one padding-free row (without its position_ids where not `positions`)."""
    batch = collate([{"input_ids": doc, "labels": doc} for doc in docs], pad_id=0)
    position_ids = {"position_ids": batch["position_ids"].to(model.device)} if positions else {}
    return model(input_ids=batch["input_ids"].to(model.device), use_cache=False, **position_ids).logits[0].float()


@torch.no_grad()
def alone(model: LlamaForCausalLM, docs: list[list[int]]) -> torch.Tensor:
    """Each document's logits from a run of its own, concatenated."""
    return torch.cat([model(input_ids=torch.tensor([doc], device=model.device), use_cache=False).logits[0].float()
                      for doc in docs])


def test_auto_attention_isolates_padding_free_documents(device: Device):
    model = tiny_llama(device, hidden=128, max_positions=4096)
    docs = documents([37, 1500, 5, 300], seed=1)
    each = alone(model, docs)
    torch.testing.assert_close(together(model, docs), each, atol=3e-2, rtol=3e-2)  # bf16 kernels, other tilings
    leaky = together(model, docs, positions=False)
    assert (leaky[37:] - each[37:]).abs().max() > 0.1  # the check can fail: without positions documents mix


def test_a_padding_free_row_longer_than_a_stretch_keeps_every_document_to_itself(device: Device):
    """On CUDA the varlen attention runs stretches of short documents as one masked sdpa call each (attention.
    MASKED_CALL_DOCUMENTS): a row of ~10k tokens in 40 documents crosses a stretch's bound."""
    model = tiny_llama(device, hidden=64, max_positions=1024)
    docs = documents(torch.randint(50, 450, (40,), generator=torch.Generator().manual_seed(2)).tolist(), seed=3)
    assert sum(map(len, docs)) > attention.MASKED_CALL_ROW
    row = together(model, docs)
    made = dict(attention._masks)  # the row's stretches' masks (the runs alone below make their own)
    torch.testing.assert_close(row, alone(model, docs), atol=3e-2, rtol=3e-2)  # bf16 kernels, other tilings
    if model.device.type in attention.MASKED_CALL_DEVICES:  # the masked calls ran (CUDA), each within the bound
        assert made and all(mask.shape[-1] <= attention.MASKED_CALL_ROW for mask in made.values())

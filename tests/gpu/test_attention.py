"""Padding-free rows on the device: the attention `auto` picks there keeps every document to itself."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.gpu.conftest import Device
from trainyard.data import collate
from trainyard.model import attention

pytestmark = pytest.mark.gpu


def test_auto_attention_isolates_padding_free_documents(device: Device):
    target = torch.device("cuda" if device.cuda else "cpu")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(target, torch.bfloat16).eval()
    model.config._attn_implementation = attention.choose("auto", model, target, training=False)
    generator = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (37, 1500, 5, 300)]
    batch = collate([{"input_ids": doc, "labels": doc} for doc in docs], pad_id=0)
    with torch.no_grad():
        together = model(input_ids=batch["input_ids"].to(target), position_ids=batch["position_ids"].to(target),
                         use_cache=False).logits[0].float()
        alone = torch.cat([model(input_ids=torch.tensor([doc], device=target), use_cache=False).logits[0].float()
                           for doc in docs])
        leaky = model(input_ids=batch["input_ids"].to(target), use_cache=False).logits[0].float()
    torch.testing.assert_close(together, alone, atol=3e-2, rtol=3e-2)  # bf16 kernels, different tilings
    assert (leaky[37:] - alone[37:]).abs().max() > 0.1  # the check can fail: without positions documents mix


def test_a_padding_free_row_longer_than_a_stretch_keeps_every_document_to_itself(device: Device):
    """On CUDA the varlen attention runs stretches of short documents as one masked sdpa call each (attention.
    MASKED_CALL_DOCUMENTS): a row of ~10k tokens in 40 documents crosses a stretch's bound."""
    target = torch.device("cuda" if device.cuda else "cpu")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to(target, torch.bfloat16).eval()
    model.config._attn_implementation = attention.choose("auto", model, target, training=False)
    generator = torch.Generator().manual_seed(2)
    lengths = torch.randint(50, 450, (40,), generator=generator).tolist()
    docs = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in lengths]
    batch = collate([{"input_ids": doc, "labels": doc} for doc in docs], pad_id=0)
    assert batch["input_ids"].shape[1] > attention.MASKED_CALL_ROW
    attention._masks.clear()
    with torch.no_grad():
        together = model(input_ids=batch["input_ids"].to(target), position_ids=batch["position_ids"].to(target),
                         use_cache=False).logits[0].float()
        alone = torch.cat([model(input_ids=torch.tensor([doc], device=target), use_cache=False).logits[0].float()
                           for doc in docs])
    torch.testing.assert_close(together, alone, atol=3e-2, rtol=3e-2)  # bf16 kernels, different tilings
    if device.cuda:  # the masked calls ran, each over a stretch within the bound
        assert attention._masks and all(m.shape[-1] <= attention.MASKED_CALL_ROW for m in attention._masks.values())

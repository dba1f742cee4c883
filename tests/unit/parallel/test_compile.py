"""train.compile: the compiled blocks give the eager model's loss and gradients."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainyard.data import collate
from trainyard.loss import token_loss_sum
from trainyard.model.attention import VARLEN
from trainyard.parallel.checkpointing import compile_blocks


def test_compiled_mlps_match_eager():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    eager = LlamaForCausalLM(config)
    eager.set_attn_implementation(VARLEN)
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == 2
    rows = [{"input_ids": list(range(1, 1 + n)), "labels": [-100] + list(range(2, 1 + n))} for n in (9, 5, 12)]
    batch = collate(rows, pad_id=0)
    losses = []
    for model in (eager, compiled):
        loss, _ = token_loss_sum(model, batch, torch.device("cpu"))
        loss.backward()
        losses.append(loss)
    assert all(block.mlp._compiled_call_impl is not None for block in compiled.model.layers)
    assert all(block.mlp._compiled_call_impl is None for block in eager.model.layers)
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for got, want in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4)

"""The training loss: logits only where a label follows, the same loss and gradients as full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trainyard.data import collate
from trainyard.loss import token_loss_sum
from trainyard.model.attention import VARLEN


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(VARLEN)
    return model


def rows() -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for length, prompt in ((7, 3), (12, 8), (4, 1)):
        ids = torch.randint(1, 96, (length,), generator=generator).tolist()
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def full_logits_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding-free", "padded"])
def test_loss_and_gradients_equal_those_of_full_logits(padding_free):
    model = tiny_llama()
    batch = collate(rows(), pad_id=0, padding_free=padding_free)
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel() // 32))
    loss, count = token_loss_sum(model, batch, torch.device("cpu"))
    hook.remove()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected = full_logits_loss(model, batch)
    expected.backward()
    assert count.item() == 4 + 4 + 3
    assert seen == [count.item()]  # the vocabulary projection ran on the target positions alone
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-6)
    for got, want in zip(grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)

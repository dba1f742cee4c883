"""The training loss: logits only where a label follows, the same loss and gradients as full logits."""

from __future__ import annotations

import peft
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tests.unit.model.families import build
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


class _LargestLogits(torch.utils._python_dispatch.TorchDispatchMode):
    """The most rows of any [rows, vocab] tensor an op makes, forward and backward."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor) and not func.is_view and tensor.shape[-1:] == (self.vocab,):
                self.rows = max(self.rows, tensor.numel() // self.vocab)
        return out


VOCAB = 101
"""No other dimension of the tiny models has this size, so a [rows, VOCAB] tensor is logits or their gradient."""


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int) -> tuple[torch.Tensor, list]:
    model.zero_grad()
    with _LargestLogits(model.config.vocab_size) as largest:
        loss, _ = token_loss_sum(model, batch, torch.device("cpu"), chunk)
        loss.backward()
    return loss.detach(), [(name, p.grad.clone()) for name, p in model.named_parameters() if p.grad is not None], \
        largest.rows


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
@pytest.mark.parametrize("padding_free", [True, False], ids=["padding-free", "padded"])
def test_chunked_logits_give_the_loss_and_gradients_of_full_logits(family: str, padding_free: bool) -> None:
    """fp32, chunks of 3 target tokens against the whole [tokens, vocab] logits: llama's head is tied to its
    embedding, gemma2 soft-caps its final logits. The sums differ only in their order (1e-6)."""
    model = build(family, "eager" if family == "gemma2" else VARLEN, vocab_size=VOCAB)
    batch = collate(rows(), pad_id=0, padding_free=padding_free)
    full_loss, full_grads, full_rows = _loss_and_grads(model, batch, 0)
    loss, grads, chunk_rows = _loss_and_grads(model, batch, 3)
    assert full_rows >= 11 and chunk_rows == 3  # 11 target tokens: whole logits, then never more than a chunk
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-6)
    assert [name for name, _ in grads] == [name for name, _ in full_grads]
    for (name, got), (_, want) in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation: the same loss, no gradient computed
        assert token_loss_sum(model, batch, torch.device("cpu"), 3)[0].item() == pytest.approx(full_loss.item(), 1e-6)


def test_lora_adapters_get_the_gradients_of_full_logits_and_the_frozen_head_none() -> None:
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_llama(), config)
    batch = collate(rows(), pad_id=0, padding_free=True)
    full_loss, full_grads, _ = _loss_and_grads(model, batch, 0)
    loss, grads, _ = _loss_and_grads(model, batch, 4)
    assert all("lora_" in name for name, _ in grads) and len(grads) == 8
    torch.testing.assert_close(loss, full_loss, rtol=1e-6, atol=1e-6)
    for (_, got), (_, want) in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _Made(torch.utils._python_dispatch.TorchDispatchMode):
    """(shape, dtype) of every tensor an op makes, views and in-place results aside."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Size, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inplace = func._schema.name.endswith("_") or any(a.is_write for a in func._schema.arguments if a.alias_info)
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor) and not func.is_view and not inplace:
                self.seen.append((tensor.shape, tensor.dtype))
        return out


def test_a_full_fine_tune_s_loss_makes_the_head_gradient_in_the_head_s_dtype_and_no_fp32_copy() -> None:
    """bf16 weights (FSDP2's unsharded parameters under bf16-mixed): the loss's forward makes one [V, H] tensor, the
    head's gradient in bf16, which backward hands on as it is; never an fp32 [V, H] beside it (2.1 GB for
    Llama-3-8B's head). The gradients are the unchunked loss's within bf16 rounding."""
    model = build("qwen3", VARLEN, vocab_size=VOCAB).to(torch.bfloat16)
    head = model.lm_head.weight
    batch = collate(rows(), pad_id=0, padding_free=True)
    with _Made() as made:
        loss, _ = token_loss_sum(model, batch, torch.device("cpu"), 3)
    assert [dtype for shape, dtype in made.seen if shape == head.shape] == [torch.bfloat16]
    held = [t for t in loss.grad_fn.saved_tensors if t is not None and t.shape == head.shape]
    assert [t.dtype for t in held] == [torch.bfloat16]
    address = held[0].data_ptr()
    del held
    loss.backward()
    assert head.grad.data_ptr() == address  # the held tensor is the gradient, not a copy of it
    chunked = {name: p.grad.float() for name, p in model.named_parameters()}
    _, full, _ = _loss_and_grads(model, batch, 0)
    for name, want in full:
        torch.testing.assert_close(chunked[name], want.float(), rtol=0.05, atol=2e-3, msg=name)

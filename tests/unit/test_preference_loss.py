"""The preference losses on packed pairs equal a plain computation on each document alone, for every dpo.loss; the
reference is the model with its adapters off."""

from __future__ import annotations

import math

import peft
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trainyard.config import DpoConfig
from trainyard.data import IGNORE_INDEX, collate
from trainyard.model.attention import VARLEN
from trainyard.model.lora import adapters_off
from trainyard.preference.loss import STATS, count_pairs, pair_loss_sum

VOCAB = 96


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(VARLEN)
    return model


def shift_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA adapters that are not zero, so policy and reference differ."""
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def lora_llama() -> torch.nn.Module:
    return shift_adapters(peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules="all-linear")))


def document(prompt: int, completion: int, generator: torch.Generator) -> tuple[list[int], list[int]]:
    ids = torch.randint(1, VOCAB, (prompt + completion,), generator=generator).tolist()
    return ids, [IGNORE_INDEX] * prompt + ids[prompt:]


def pair_rows() -> list[dict[str, list[int]]]:
    """Three pairs whose completions differ in length, as data/preference.py stores them."""
    generator = torch.Generator().manual_seed(5)
    rows = []
    for prompt, chosen, rejected in ((3, 4, 6), (5, 2, 2), (2, 7, 3)):
        c_ids, c_labels = document(prompt, chosen, generator)
        r_ids, r_labels = document(prompt, rejected, generator)
        rows.append({"input_ids": c_ids + r_ids, "labels": c_labels + r_labels, "seq_lens": [len(c_ids), len(r_ids)]})
    return rows


def alone(model: torch.nn.Module, ids: list[int], labels: list[int]) -> tuple[torch.Tensor, int]:
    """Summed log p of one document's completion, computed on it alone, and its token count."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    targets = torch.tensor(labels[1:])
    picked = torch.log_softmax(logits, -1)[targets != IGNORE_INDEX].gather(1, targets[targets != IGNORE_INDEX, None])
    return picked.sum(), int((targets != IGNORE_INDEX).sum())


def plain_loss(model: torch.nn.Module, rows: list[dict], cfg: DpoConfig) -> tuple[torch.Tensor, list[float]]:
    """The mean loss over the pairs and the mean of each figure, written out pair by pair."""
    losses, figures, chosen_sequences = [], [], []
    for row in rows:
        cut = row["seq_lens"][0]
        docs = [(row["input_ids"][:cut], row["labels"][:cut]), (row["input_ids"][cut:], row["labels"][cut:])]
        (pc, nc), (pr, nr) = [alone(model, *doc) for doc in docs]
        chosen_sequences.append(alone(model, docs[0][0], [IGNORE_INDEX] + docs[0][0][1:]))
        with torch.no_grad(), model.disable_adapter():
            (rc, _), (rr, _) = [alone(model, *doc) for doc in docs]
        b = cfg.beta
        if cfg.loss == "sigmoid":
            z = b * ((pc - rc) - (pr - rr))
            loss = -(1 - cfg.label_smoothing) * F.logsigmoid(z) - cfg.label_smoothing * F.logsigmoid(-z)
        elif cfg.loss == "robust":
            e = cfg.label_smoothing
            z = b * ((pc - rc) - (pr - rr))
            loss = (-(1 - e) * F.logsigmoid(z) + e * F.logsigmoid(-z)) / (1 - 2 * e)
        elif cfg.loss == "hinge":
            loss = torch.clamp(1 - b * ((pc - rc) - (pr - rr)), min=0)
        elif cfg.loss == "ipo":
            loss = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * b)) ** 2
        elif cfg.loss == "simpo":
            loss = -F.logsigmoid(b * (pc / nc - pr / nr) - cfg.simpo_gamma)
        else:  # orpo: odds(p) = p / (1 - p) of the mean token log-probability; the batch's NLL is added below
            odds = (pc / nc - torch.log(1 - torch.exp(pc / nc))) - (pr / nr - torch.log(1 - torch.exp(pr / nr)))
            loss = -b * F.logsigmoid(odds)
        if cfg.loss in ("simpo", "orpo"):
            chosen, rejected, logps = b * pc / nc, b * pr / nr, (pc / nc, pr / nr)
        else:
            chosen, rejected, logps = b * (pc - rc), b * (pr - rr), (pc, pr)
        losses.append(loss)
        chosen, rejected, logps = chosen.detach(), rejected.detach(), [value.detach() for value in logps]
        figures.append([float(chosen), float(rejected), float(chosen - rejected), float(chosen > rejected),
                        *map(float, logps)])
    loss = torch.stack(losses).mean()
    if cfg.loss == "orpo":  # the chosen sequences' cross-entropy, prompts included, over all their tokens
        loss = loss - sum(s for s, _ in chosen_sequences) / sum(n for _, n in chosen_sequences)
    return loss, [sum(column) / len(rows) for column in zip(*figures)]


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize(
    ("settings", "padding_free", "chunk_tokens"),
    [({"loss": "sigmoid"}, True, 3), ({"loss": "sigmoid", "label_smoothing": 0.2}, False, 0),
     ({"loss": "hinge", "beta": 2.0}, True, None), ({"loss": "ipo", "beta": 0.5}, True, 5),
     ({"loss": "robust", "label_smoothing": 0.1}, True, None),
     ({"loss": "simpo", "beta": 2.0, "simpo_gamma": 0.3}, True, None), ({"loss": "orpo"}, True, 4),
     ({"loss": "orpo"}, False, None)],
    ids=["sigmoid-chunks-of-3", "sigmoid-smoothed-padded-full-logits", "hinge", "ipo-chunks-of-5", "robust", "simpo",
         "orpo-chunks-of-4", "orpo-padded"],
)
def test_packed_pairs_equal_each_document_alone(settings: dict, padding_free: bool, chunk_tokens: int | None) -> None:
    """train.loss_chunk_tokens: the head's logits a few tokens at a time (forward, and again in the backward), or
    all at once (0): the same loss, figures and gradients."""
    cfg = DpoConfig(**settings)
    model = lora_llama()
    rows = pair_rows()
    batch = collate(rows, 0, padding_free)
    loss_sum, stats = pair_loss_sum(model, batch, torch.device("cpu"), cfg, chunk_tokens)
    assert count_pairs(batch) == 3
    want_loss, want_figures = plain_loss(model, rows, cfg)
    torch.testing.assert_close(loss_sum / 3, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close((stats / 3).tolist(), want_figures, rtol=1e-4, atol=1e-5)  # fp32 sums of ~20
    assert len(STATS) == len(want_figures) and not math.isclose(want_figures[2], 0.0)
    for got, want in zip(gradients(model, loss_sum / 3), gradients(model, want_loss), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_adapters_off_is_the_base_model_and_comes_back_on() -> None:
    model = lora_llama()
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.no_grad():
        on = model(input_ids=ids).logits
        with adapters_off(model):
            off = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    torch.testing.assert_close(off, base, rtol=0, atol=0)
    torch.testing.assert_close(again, on, rtol=0, atol=0)
    assert not torch.allclose(on, off)
    assert all(p.requires_grad for name, p in model.named_parameters() if "lora_" in name)


def full_fine_tune_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_tokens: int,
                         autocast: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of a full fine-tune's sigmoid loss (its reference log-probabilities stored)."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, _ = pair_loss_sum(model, batch, torch.device("cpu"), DpoConfig(loss="sigmoid"), chunk_tokens)
    loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def stored_reference_batch() -> dict[str, torch.Tensor]:
    batch = collate(pair_rows(), 0, True)
    batch["ref_logps"] = torch.tensor([[-30.0, -40.0], [-20.0, -15.0], [-50.0, -20.0]])
    return batch


def test_chunked_logits_under_autocast_give_the_gradients_of_full_logits() -> None:
    """bf16-mixed full fine-tuning (fp32 weights, autocast): the chunked backward computes its logits again in the
    forward's bf16 against the forward's log-sum-exp (it computed them in fp32, outside autocast: every gradient
    was off by ~1%). The head's logits scaled to a trained model's spread, where bf16 rounds them visibly. Below the
    head the gradients are the full logits' (bitwise on an avx2 CPU); the head's own differs by the bf16 rounding
    of the full logits' one product, which the chunks sum in fp32."""
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    batch = stored_reference_batch()
    full = full_fine_tune_grads(model, batch, 0, autocast=True)
    chunked = full_fine_tune_grads(model, batch, 3, autocast=True)
    for name, want in full.items():
        error = ((chunked[name] - want).norm() / want.norm()).item()
        assert error < (1e-2 if name == "lm_head.weight" else 1e-3), (name, error)


def test_a_bf16_head_s_gradient_is_summed_in_bf16_with_no_fp32_copy() -> None:
    """bf16 weights (FSDP2's unsharded parameters under bf16-mixed): the chunked backward makes the head's gradient
    once, in bf16 (2 bytes a head parameter, as the estimate counts), never an fp32 [V, H] and a copy of it."""
    from tests.unit.test_loss import _Made

    model = tiny_llama().to(torch.bfloat16)
    head = model.lm_head.weight
    batch = stored_reference_batch()
    with torch.autocast("cpu", enabled=False):
        loss, _ = pair_loss_sum(model, batch, torch.device("cpu"), DpoConfig(loss="sigmoid"), 3)
    with _Made() as made:
        loss.backward()
    same_shape = [name for name, param in model.named_parameters() if param.shape == head.shape]
    assert same_shape == ["model.embed_tokens.weight", "lm_head.weight"]
    # one gradient each, in bf16: the embedding's and the head's
    assert [dtype for shape, dtype in made.seen if shape == head.shape] == [torch.bfloat16] * 2
    chunked = {name: param.grad.float() for name, param in model.named_parameters()}
    for name, want in full_fine_tune_grads(model, batch, 0, autocast=False).items():
        torch.testing.assert_close(chunked[name], want.float(), rtol=0.05, atol=2e-3, msg=name)

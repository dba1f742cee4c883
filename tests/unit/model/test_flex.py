"""trainyard's flex_attention (model/flex.py) computes each family's own function: Gemma 2's soft-capping and gpt-oss's
sinks against the family's eager attention on each document alone, on packed and on padded rows, losses and
gradients in fp32 within 1e-5.

flex_attention runs here as on a CPU it can: eagerly, torch's dense reference of the kernel, whose backward torch
refuses on a CPU (a device check, turned off here); on CUDA the same call runs compiled (not checked here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

from tests.unit.model.families import build, documents
from tests.unit.model.test_families import TOLERANCE, differences, reference
from trainyard.model import attention, flex

CUDA = torch.device("cuda")


@pytest.fixture
def backward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *tensors: None)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_flex_on_packed_documents_is_the_family_s_eager_attention(family: str, backward_on_cpu: None) -> None:
    ref, ref_loss = reference(family)
    loss_rel, grad_rel = differences(family, attention.FLEX, ref, ref_loss)
    assert loss_rel < TOLERANCE and grad_rel < TOLERANCE, (loss_rel, grad_rel)
    assert set(flex._last_masks[1]) == {(1, 8), (1, None)}  # documents' block masks, windowed and full layers


def _padded_loss(model: torch.nn.Module) -> torch.Tensor:
    """One document per row, right-padded, under a 2-D attention_mask: the mean loss over every target."""
    docs = documents()
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    labels = torch.full((len(docs), width), -100)
    for row, d in enumerate(docs):
        ids[row, : len(d)], mask[row, : len(d)], labels[row, : len(d)] = d, 1, d
    return model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_flex_on_padded_rows_is_the_family_s_eager_attention(family: str, backward_on_cpu: None) -> None:
    ref, ref_loss = reference(family)
    model = build(family, attention.FLEX)
    model.load_state_dict(ref.state_dict())
    loss = _padded_loss(model)
    loss.backward()
    assert abs(loss.item() - ref_loss) / ref_loss < TOLERANCE
    for mine, theirs in zip(model.parameters(), ref.parameters()):
        rel = ((mine.grad - theirs.grad).abs().max() / theirs.grad.abs().max().clamp_min(1e-12)).item()
        assert rel < TOLERANCE, rel


def test_auto_runs_soft_capping_and_sinks_through_flex_on_cuda_only() -> None:
    """flash_attn does not import here: on a GPU Gemma 2 would get flash-attention with it, flex without."""
    for family in ("gemma2", "gpt_oss"):
        model = build(family, "eager")
        assert attention.choose("auto", model, CUDA) == attention.FLEX
        assert attention.choose("flex_attention", model, CUDA) == attention.FLEX
        assert attention.choose("auto", model, torch.device("cpu")) == attention.VARLEN
    assert attention.choose("auto", build("gemma2", "eager", attention_dropout=0.1), CUDA) == attention.VARLEN
    # soft-capping recomputed under activation checkpointing stays on the family's eager attention; sinks do not
    assert attention.choose("auto", build("gemma2", "eager"), CUDA, checkpointing="selective") == attention.VARLEN
    assert attention.choose("auto", build("gpt_oss", "eager"), CUDA, checkpointing=True) == attention.FLEX
    assert attention.choose("auto", build("mistral", "eager"), CUDA) == attention.TORCH_VARLEN  # torch's kernel keeps it


def test_generation_under_flex_is_the_family_s_eager_generation() -> None:
    """Eval's greedy answers (gpt-oss): left-padded prompts prefilled through flex's block mask of the padding, then
    decoded a token at a time (varlen: the family's eager attention over the cache)."""
    first, second = documents()[:2]
    ids = torch.stack([first[:9], torch.cat([torch.zeros(3, dtype=torch.long), second[:6]])])
    runs = {}
    for implementation in ("eager", attention.FLEX):
        model = build("gpt_oss", implementation)
        runs[implementation] = model.generate(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=6,
                                              do_sample=False, pad_token_id=0, output_logits=True,
                                              return_dict_in_generate=True)
    eager, flexed = runs["eager"], runs[attention.FLEX]
    assert torch.equal(eager.sequences, flexed.sequences)
    for want, got in zip(eager.logits, flexed.logits):  # the first: the prefill's last position
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)

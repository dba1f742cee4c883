"""Padding-free rows on the device: the attention `auto` picks there keeps every document to itself."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.gpu.conftest import Device
from trainyard.data import collate
from trainyard.model import attention, torch_varlen
from trainyard.model.documents import model_inputs

pytestmark = pytest.mark.gpu


def tiny_llama(device: Device, hidden: int, max_positions: int, implementation: str = "auto") -> LlamaForCausalLM:
    """A bf16 Llama on the device, under the attention auto chooses there (or `implementation`)."""
    target = torch.device("cuda" if device.cuda else "cpu")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    model = LlamaForCausalLM(config).to(target, torch.bfloat16).eval()
    model.config._attn_implementation = attention.choose(implementation, model, target, training=False)
    return model


def documents(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def together(model: LlamaForCausalLM, docs: list[list[int]], positions: bool = True) -> torch.Tensor:
    """The documents' logits as one padding-free row as the training loop passes it (model_inputs: the collator's
    bounds), or without its position_ids and bounds where not `positions`."""
    batch = collate([{"input_ids": doc, "labels": doc} for doc in docs], pad_id=0)
    if not positions:
        batch = {"input_ids": batch["input_ids"]}
    inputs = model_inputs(batch, model.device, model.config)
    return model(**inputs, use_cache=False).logits[0].float()


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
    model = tiny_llama(device, hidden=64, max_positions=1024, implementation="varlen")
    docs = documents(torch.randint(50, 450, (40,), generator=torch.Generator().manual_seed(2)).tolist(), seed=3)
    assert sum(map(len, docs)) > attention.MASKED_CALL_ROW
    row = together(model, docs)
    made = dict(attention._masks)  # the row's stretches' masks (the runs alone below make their own)
    torch.testing.assert_close(row, alone(model, docs), atol=3e-2, rtol=3e-2)  # bf16 kernels, other tilings
    if model.device.type in attention.MASKED_CALL_DEVICES:  # the masked calls ran (CUDA), each within the bound
        assert made and all(mask.shape[-1] <= attention.MASKED_CALL_ROW for mask in made.values())


@pytest.mark.parametrize(("window", "kv_heads", "head_dim"), [(None, 2, 64), (64, 2, 64), (None, 8, 128)])
def test_torch_s_varlen_kernel_computes_the_contract_its_cpu_reference_checks(device: Device, window, kv_heads,
                                                                               head_dim):
    """The kernel auto runs on CUDA against torch_varlen.reference, which the CPU suite checks against every family's
    eager attention (tests/unit/model/test_families.py): causal per document, windows, GQA, forward and backward."""
    if not device.cuda or torch_varlen.KERNEL is None:
        pytest.skip("torch's varlen kernel runs on CUDA only")
    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 1500, 5, 300, 1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), heads, head_dim, device="cuda", generator=generator, dtype=torch.bfloat16,
                           requires_grad=True) for heads in (8, kv_heads, kv_heads))
    options = dict(scale=head_dim**-0.5, window_size=(window - 1, 0) if window else (-1, 0),
                   **({"enable_gqa": True} if kv_heads != 8 else {}))
    if kv_heads != 8 and not torch_varlen.GQA:
        pytest.skip("this torch's varlen kernel has no enable_gqa (the attention repeats KV heads instead)")
    outputs, grads = [], []
    for run in (torch_varlen.KERNEL, torch_varlen.reference):
        out = run(q, k, v, cu, cu, max(lengths), max(lengths), **options)
        out.float().square().sum().backward()
        outputs.append(out.float())
        grads.append([x.grad.float().clone() for x in (q, k, v)])
        for x in (q, k, v):
            x.grad = None
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-2, rtol=2e-2)  # bf16, other tilings
    for mine, theirs in zip(*grads):
        torch.testing.assert_close(mine, theirs, atol=5e-2, rtol=5e-2)


def test_auto_runs_torch_s_varlen_kernel_on_cuda(device: Device):
    if not device.cuda:
        pytest.skip("auto picks the kernel on CUDA only")
    model = tiny_llama(device, hidden=128, max_positions=4096)
    expected = "flash_attention_2" if attention._has_flash_attn() else attention.TORCH_VARLEN
    assert model.config._attn_implementation == expected


def test_a_full_fine_tune_s_fp32_layers_run_the_kernel_under_autocast(device: Device):
    """fp32 weights at bf16-mixed: rotary embeddings hand the attention fp32 queries and keys. It still runs the
    kernel, in autocast's bf16 as sdpa would (its bf16 output says so: the fallback keeps fp32), and computes what
    the reference computes on the same operands in bf16."""
    if not device.cuda or torch_varlen.KERNEL is None:
        pytest.skip("torch's varlen kernel runs on CUDA only")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    layer = LlamaForCausalLM(config).cuda().model.layers[0].self_attn
    lengths = [37, 200, 5]
    query, key, value = (torch.randn(1, heads, sum(lengths), 32, device="cuda") for heads in (4, 2, 2))
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": max(lengths),
              "max_length_k": max(lengths), "scaling": 32**-0.5}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = torch_varlen.torch_varlen_attention(layer, query, key, value, None, **kwargs)
    assert out.dtype == torch.bfloat16
    q, k, v = (x[0].transpose(0, 1).bfloat16() for x in (query, key, value))
    cu = bounds.cuda()
    gqa = {"enable_gqa": True} if torch_varlen.GQA else {}
    if not gqa:
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = torch_varlen.reference(q, k, v, cu, cu, max(lengths), max(lengths), scale=32**-0.5,
                                  window_size=(-1, 0), **gqa)
    torch.testing.assert_close(out[0].float(), want.float(), atol=2e-2, rtol=2e-2)

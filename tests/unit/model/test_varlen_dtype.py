"""torch's varlen kernel computes in half precision: the dtype it takes for a layer's operands, autocast's where a
full fine-tune's rotary embeddings made them fp32 (on CUDA such a layer went to the per-document loop before)."""

from __future__ import annotations

import torch

from trainyard.model import torch_varlen


def test_fp32_operands_take_autocast_s_half_dtype_and_none_without_it() -> None:
    query = torch.zeros(1, 2, 4, 8)
    assert torch_varlen.half_dtype(query) is None  # an fp32 job: trainyard's varlen keeps fp32
    assert torch_varlen.half_dtype(query.bfloat16()) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_varlen.half_dtype(query) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert torch_varlen.half_dtype(query) is None


def test_a_layer_with_softcapping_or_dropout_is_not_kept_whatever_its_dtype() -> None:
    query = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    assert torch_varlen.kept(query, {}, training=True)
    assert not torch_varlen.kept(query, {"softcap": 30.0}, training=True)
    assert not torch_varlen.kept(query, {"dropout": 0.1}, training=True)
    assert torch_varlen.kept(query, {"dropout": 0.1}, training=False)

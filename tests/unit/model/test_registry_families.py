"""Every causal-LM family transformers registers that trainyard claims (registry.py): trainyard's default job on
padding-free rows computes what the family's own eager model computes on padded rows over 4 fp32 steps (exact, or
exact on the padded rows trainyard collates for it, saying why), or is refused with exit 2 naming why; the committed
matrix (the docs' support table) is what the code gives now.

Tolerance: 1e-5 relative, as in test_families.py (the differences seen are below 3e-7)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.model import matrix, registry
from trainyard.config import DataConfig
from trainyard.data.collate import collate
from trainyard.errors import ModelError
from trainyard.model import collation
from trainyard.model import attention, layers

COMMITTED = json.loads(matrix.MATRIX.read_text())


def test_the_matrix_holds_every_claimed_family_of_the_registry() -> None:
    """A transformers upgrade that adds a family changes the claimed set: rerun `python -m tests.unit.model.matrix`."""
    assert sorted(COMMITTED) == sorted(registry.claimed())
    assert {"bart", "bert", "gemma3", "llama4", "qwen3_5"}.isdisjoint(registry.claimed())
    assert {"llama", "qwen3_next", "llama4_text", "falcon_h1", "jamba", "mamba"} <= set(registry.claimed())


@pytest.mark.parametrize("family", registry.claimed())
def test_the_default_job_is_exact_or_refused_as_the_matrix_says(family: str) -> None:
    found = matrix.outcome(family)
    if found["result"] != matrix.REFUSED:
        assert found["rel"] < matrix.TOLERANCE, found
    assert {key: value for key, value in found.items() if key != "rel"} == COMMITTED[family]


@pytest.mark.parametrize(("family", "why"), [("mamba", "MambaMixer, Conv1d"), ("rwkv", "RwkvSelfAttention, ZeroPad2d")])
def test_the_check_can_fail_one_row_of_documents_joins_them(family: str, why: str) -> None:
    """What trainyard's defaults trained before: a state-space model and RWKV read a padding-free row as one
    document."""
    want = matrix.losses(matrix.build(family), collate(matrix.rows(), pad_id=0, padding_free=False))[0]
    model = matrix.build(family)
    assert collation.padded_rows(model, DataConfig()).startswith(
        f"{family} has {why} layers that carry state across documents")
    joined = matrix.losses(model, collate(matrix.rows(), pad_id=0, padding_free=True))[0]
    assert abs(joined - want) / want > 20 * matrix.TOLERANCE


def test_a_family_with_attention_of_its_own_gets_its_own_mask_and_padded_rows() -> None:
    """GPT-NeoX-Japanese computes its attention itself from the mask transformers makes for the implementation
    named: varlen's would change even its padded rows. (Falcon was the example until transformers 5.25 moved it onto
    the attention interface: it is exact on padding-free rows there.)"""
    model = matrix.build("gpt_neox_japanese")
    assert layers.own_attention(model) == ["GPTNeoXJapaneseAttention"]
    assert attention.choose("auto", model, torch.device("cpu")) == "eager"  # it has no sdpa path
    with pytest.raises(ModelError, match=r"varlen: GPTNeoXJapaneseAttention computes attention in its own code"):
        attention.choose("varlen", model, torch.device("cpu"))  # asked for by name: refused, not trained wrong
    assert "GPTNeoXJapaneseAttention (its own attention" in collation.padded_rows(model, DataConfig())
    want = matrix.losses(matrix.build("gpt_neox_japanese"), collate(matrix.rows(), pad_id=0, padding_free=False))[0]
    model.config._attn_implementation = attention.VARLEN  # set after the build, as trainyard sets it
    varlen = matrix.losses(model, collate(matrix.rows(), pad_id=0, padding_free=False))[0]
    assert abs(varlen - want) / want > 20 * matrix.TOLERANCE


def test_a_window_only_transformers_mask_keeps_goes_to_sdpa() -> None:
    """PhiMoE's layers do not give their attention the window: trainyard's varlen would attend past it."""
    model = matrix.build("phimoe")
    assert layers.window_only_in_mask(model) == ["PhimoeAttention"]
    assert attention.choose("auto", model, torch.device("cpu")) == "sdpa"
    with pytest.raises(ModelError, match=r"varlen drops the sliding windows \(its layers do not give their attention"):
        attention.refuse_dropped("varlen", model)
    want = matrix.losses(matrix.build("phimoe"), collate(matrix.rows(), pad_id=0, padding_free=False))[0]
    dropped = matrix.build("phimoe", attention.VARLEN)
    got = matrix.losses(dropped, collate(matrix.rows(), pad_id=0, padding_free=True))[0]
    assert abs(got - want) / want > 20 * matrix.TOLERANCE


def test_layers_that_compute_each_token_alone_are_not_refused() -> None:
    """GPT-2's Conv1D is a linear map; a Mamba norm is a norm, not a state-space layer."""
    assert layers.unknown_layers(matrix.build("gpt2")) == []
    assert layers.carriers(matrix.build("gpt2")) == []
    assert layers.carriers(matrix.build("falcon_mamba")) == ["FalconMambaMixer", "Conv1d"]

"""The estimate's state layers (estimate/state_memory.py): each decoder block counted by what it holds, as each
family lays its layers out, and the chunked scans' padding per document. Their bytes are checked against the
trace (tests/unit/train/test_trace.py). Meta-built models only: a few seconds in all."""

from __future__ import annotations

import json

import pytest

from tests.unit.model import registry
from trainyard import hardware, loss
from trainyard.batch import MicroBatch
from trainyard.config_file import load_config
from trainyard.estimate import memory, state_memory
from trainyard.estimate.state_memory import DELTA, MAMBA1, MAMBA2, SHORT_CONV


def _model(tmp_path, family: str, **changes: object) -> memory.Model:
    widths = {**registry.settings(family), **changes}
    config = "\n".join(f"    {key}: {json.dumps(value)}" for key, value in widths.items()
                       if key != "vocab_size" and value is not None)
    job = tmp_path / f"{family}.yaml"
    job.write_text(f"model:\n  config:\n{config}\n  tokenizer: builtin:bytes\n")
    return memory.model_of(load_config(str(job)))


@pytest.mark.parametrize(("family", "changes", "layout"), [
    ("qwen3_next", {}, [(DELTA, False), (None, True)]),  # layer_types
    ("falcon_h1", {}, [(MAMBA2, True), (MAMBA2, True)]),  # Mamba2 beside attention in every layer
    ("lfm2", dict(layer_types=["conv", "full_attention"], full_attn_idxs=None), [(SHORT_CONV, False), (None, True)]),
    ("nemotron_h", dict(hybrid_override_pattern="M*-", layers_block_type=None, sliding_window=None),
     [(MAMBA2, False), (None, True), (None, False)]),  # its pattern: Mamba2, attention, MLP
    ("jamba", {}, [(MAMBA1, False), (None, True)]),  # attn_layer_period 2, offset 1
])
def test_each_block_is_counted_by_the_layers_it_holds(tmp_path, family: str, changes: dict, layout: list) -> None:
    blocks = _model(tmp_path, family, **changes).counts.blocks
    assert [(block.mixers[0].kind if block.mixers else None, block.attention) for block in blocks] == layout


def test_a_family_of_attention_alone_keeps_its_one_layer_formula(tmp_path) -> None:
    assert _model(tmp_path, "qwen3_next", layer_types=["full_attention"] * 2).counts.blocks == ()


def test_a_document_pads_to_whole_chunks_of_the_scan(tmp_path) -> None:
    """The delta rule runs each document in chunks of 64: 63 documents of 65 tokens hold twice the chunk terms of
    one of 4,095 (64 chunks, its last padded by one token), as padded rows or rows split per document run them;
    the layers' other tensors are per real token."""
    model = _model(tmp_path, "qwen3_next")
    delta = model.counts.blocks[0].mixers[0]
    assert state_memory.chunked(65, 64) == 128 / 65 and state_memory.chunked(4096, 64) == 1.0
    cfg = load_config(str(tmp_path / "qwen3_next.yaml"))
    layout = memory.resolve_strategy(cfg, model, hardware.gpu("h100-80gb"), 1, 1)
    precision = memory.resolve_precision(cfg, layout.gpu)
    one, many = (memory.memory(cfg, model, layout, precision, MicroBatch(4095, longest)).activations
                 for longest in (4095, 65))
    size = memory.dtypes(cfg, precision, "none")
    padded = (state_memory.saved_per_token(delta, 65, size, False)
              - state_memory.saved_per_token(delta, 4095, size, False)) * 4095
    assert many - one == pytest.approx(padded, rel=1e-6) and many > 1.3 * one


def test_the_estimate_knows_which_families_losses_run_in_chunks() -> None:
    """Any other keeps its whole fp32 logits and their gradient (Qwen3-Next, Falcon-H1, LFM2...)."""
    assert memory.CHUNKED_LOSS_FAMILIES == loss.CHUNKED_FAMILIES

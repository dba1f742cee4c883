"""`trainyard estimate` for families with no attention layer at all (Mamba, Mamba2): their FLOPs are their
weights' (no attention term), their memory their state layers' (estimate/state_memory.py), and the command runs."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.unit.model import registry
from trainyard import estimate, hardware
from trainyard.config_file import load_config
from trainyard.estimate import memory
from trainyard.estimate.state_memory import MAMBA1, MAMBA2

H100 = estimate.Hardware("h100-80gb", 1, 1)
KINDS = {"mamba": MAMBA1, "mamba2": MAMBA2}


def _job(tmp_path, family: str) -> str:
    widths = registry.settings(family)
    config = "\n".join(f"    {key}: {json.dumps(value)}" for key, value in widths.items()
                       if key != "vocab_size" and value is not None)
    job = tmp_path / f"{family}.yaml"
    job.write_text(f"model:\n  config:\n{config}\n  tokenizer: builtin:bytes\ndata:\n  max_length: 256\n")
    return str(job)


@pytest.mark.parametrize("family", sorted(KINDS))
def test_an_attention_free_family_is_counted_by_its_state_layers(tmp_path, family: str) -> None:
    """No attention term in the FLOPs (no heads, no windows): 6 FLOPs per matmul weight and token under full
    fine-tuning; each layer's state layer is counted once, its saved tensors growing with the documents."""
    cfg = load_config(_job(tmp_path, family), ["lora.enabled=false"])
    model = memory.model_of(cfg)
    flops = model.counts.flops
    assert (flops.heads, flops.windows) == (0, ())
    assert hardware.flops_per_token(flops, [256.0]) == 6 * flops.active > 0
    blocks = model.counts.blocks  # Mamba's mixer is a block of its own (FSDP's unit) inside its layer's
    assert [mixer.kind for block in blocks for mixer in block.mixers] == [KINDS[family]] * 2
    assert not any(block.attention for block in blocks)
    result = estimate.estimate(cfg, H100)
    assert result.timing.flops_per_token == 6 * flops.active
    longer = estimate.estimate(load_config(_job(tmp_path, family), ["lora.enabled=false", "data.max_length=1024"]),
                               H100)
    assert 3.5 * result.memory.activations < longer.memory.activations < 4.5 * result.memory.activations


@pytest.mark.parametrize("family", sorted(KINDS))
def test_the_command_estimates_an_attention_free_family(tmp_path, family: str) -> None:
    result = run_cli("estimate", _job(tmp_path, family), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    assert figures["memory_bytes"]["activations"] > 0 and figures["time"]["flops_per_token"] > 0

"""FSDP2 + LoRA on 2 ranks trains the families whose layers carry state across documents (on padding-free rows, each
such layer running each document on its own: model/state_layers.py), one of each kind the registry adds to the attention-only and MoE families of
test_model_families.py: Gated DeltaNet linear attention with MoE (Qwen3-Next) and Mamba2 beside attention
(Falcon-H1). Their weights round-trip through export: merged and unmerged, what plain transformers and PEFT load
computes what the run's final checkpoint computes (to fp32 rounding: the experts' adapters run another way in PEFT).
Each run shares the session's world."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.conftest import TINY, train_in
from tests.dist.checkpoint_helpers import COMMON, LORA_FSDP, model_tensors
from tests.unit.model import registry
from tests.world import World
from trainyard.checkpoint.export import export
from trainyard.checkpoint.save import step_dir
from trainyard.config_file import load_config
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import source as source_room

pytestmark = pytest.mark.dist

FAMILIES = ("qwen3_next", "falcon_h1")
TOKENIZER_KEYS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")
STEPS = 2


@pytest.fixture(scope="module", params=FAMILIES)
def run_dir(request: pytest.FixtureRequest, world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    settings = {k: v for k, v in registry.settings(family).items() if k not in TOKENIZER_KEYS}
    out = tmp_path_factory.mktemp(family)
    summary = train_in(world, TINY, f"output_dir={out}", *COMMON, *LORA_FSDP, f"model.config={json.dumps(settings)}",
                       "model.tokenizer=builtin:bytes", f"train.max_steps={STEPS}", f"checkpoint.every_steps={STEPS}",
                       "train.precision=fp32", "train.micro_batch_size=4", "train.global_batch_size=8")
    assert summary["world_size"] == 2, summary
    return out / Path(TINY).stem


def trained_model(run: Path) -> torch.nn.Module:
    """The job's base, LoRA as the trainer adds it, every trained tensor of the final full checkpoint on top."""
    cfg = load_config(str(run / "config.yaml"))
    tokenizer = source_room.load_tokenizer(cfg.model, None)
    model = lora_room.apply_lora(model_room.load_model(cfg.model, None, tokenizer, torch.float32, cfg.train.seed),
                                 cfg.lora, cfg.train.seed)
    result = model.load_state_dict(model_tensors(step_dir(run / "checkpoints", STEPS)), strict=False)
    assert not result.unexpected_keys
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_fsdp2_lora_trains_and_the_weights_round_trip_through_export(run_dir: Path, tmp_path: Path) -> None:
    want_model = trained_model(run_dir)
    assert any(p.abs().sum() > 0 for n, p in want_model.named_parameters() if "lora_B" in n)  # the adapters trained
    want = logits(want_model)
    unmerged = export(step_dir(run_dir / "checkpoints", STEPS), tmp_path / "unmerged")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(unmerged), str(unmerged / "adapter"))
    # PEFT's own expert forward folds W + B·A; trainyard's grouped adapter adds (x·Aᵀ)·Bᵀ: equal to rounding
    torch.testing.assert_close(logits(adapted.eval()), want, rtol=1e-5, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(export(run_dir, tmp_path / "merged", merge_lora=True)).eval()
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logits(merged), want, rtol=1e-5, atol=1e-5)

"""One HF-config resolver: the estimate counts the parameters of exactly the model the build makes, for every
shipped config whose architecture this machine has (the hub ones come from the estimator's table)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from trainyard.config_file import load_config
from trainyard.estimate import arch as estimate_arch
from trainyard.estimate import memory as estimate_memory
from trainyard.model import build as model_room
from trainyard.model import lora as lora_room
from trainyard.model import source as source_room

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def built_counts(config_path: Path) -> tuple[int, int]:
    """The build's way: the tokenizer, the one resolver, the meta model with LoRA."""
    cfg = load_config(str(config_path))
    if cfg.model.config is None and cfg.model.path in estimate_arch.KNOWN_ARCHITECTURES:
        pytest.skip(f"{cfg.model.path} is not on this machine: the build would download it")
    model_path = source_room.resolve_model_path(cfg.model) if cfg.model.path else None
    tokenizer, why = source_room.offline_tokenizer(cfg.model)
    if tokenizer is None and "vocab_size" not in (cfg.model.config or {}):
        pytest.skip(why)
    config = source_room.architecture(cfg.model, tokenizer, model_path)
    model = model_room.build_meta_model(cfg.model, config, torch.float32, torch.device("cpu"))
    if cfg.lora.enabled:
        with lora_room.real_stand_ins(model, torch.float32):
            model = lora_room.apply_lora(model, cfg.lora, cfg.train.seed)
    return model_room.parameter_counts(model)


@pytest.mark.parametrize("config_path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_the_estimate_counts_the_parameters_of_the_model_the_build_makes(config_path: Path) -> None:
    counts = estimate_memory.model_of(load_config(str(config_path))).counts
    assert (counts.total, counts.trainable) == built_counts(config_path)

"""Uninterrupted reference runs shared by the checkpoint tests, made once per test run on the shared world (the
runs that tests compare them with are real launches, killed and resumed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, TINY_MOE, train_in
from tests.dist.checkpoint_helpers import COMMON, FULL_FSDP, LORA_DDP, LORA_FSDP
from tests.world import World


def _reference(world: World, out: Path, overrides: list[str], config: str = TINY) -> Path:
    train_in(world, config, f"output_dir={out}", *COMMON, *overrides)
    return out / Path(config).stem


@pytest.fixture(scope="session")
def lora_reference(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DDP + LoRA, synchronous checkpoints, never interrupted: its run dir. The final eval changes no weight;
    `trainyard eval` is checked against it."""
    return _reference(world, tmp_path_factory.mktemp("lora-reference"), [*LORA_DDP, "eval.at_end=true"])


@pytest.fixture(scope="session")
def full_reference(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP2 + full fine-tuning, synchronous checkpoints, never interrupted: its run dir."""
    return _reference(world, tmp_path_factory.mktemp("full-reference"), [*FULL_FSDP, "eval.at_end=true"])


@pytest.fixture(scope="session")
def fsdp_lora_reference(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP2 + LoRA (seed 000's setup), never interrupted, every full checkpoint kept."""
    return _reference(
        world, tmp_path_factory.mktemp("fsdp-lora-reference"), [*LORA_FSDP, "checkpoint.keep_last=6", "eval.at_end=true"]
    )


@pytest.fixture(scope="session")
def moe_reference(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-moe (seed 000 in miniature): FSDP2 + LoRA on attention and routed experts, never
    interrupted, every full checkpoint kept: its run dir."""
    return _reference(world, tmp_path_factory.mktemp("moe-reference"), [*LORA_FSDP, "checkpoint.keep_last=6"],
                      config=TINY_MOE)

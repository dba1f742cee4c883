"""Uninterrupted reference runs shared by the checkpoint tests (each costs a 2-rank run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_MOE, assert_ok, trainyard
from tests.dist.checkpoint_helpers import FULL_FSDP, LORA_DDP, LORA_FSDP, train_args


def _reference(out: Path, overrides: list[str]) -> Path:
    # The final eval changes no weight; `trainyard eval` is checked against it.
    assert_ok(trainyard(*train_args(out, *overrides, "eval.at_end=true")))
    return out / "tiny"


@pytest.fixture(scope="session")
def lora_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DDP + LoRA, synchronous checkpoints, never interrupted: its run dir."""
    return _reference(tmp_path_factory.mktemp("lora-reference"), LORA_DDP)


@pytest.fixture(scope="session")
def full_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP2 + full fine-tuning, synchronous checkpoints, never interrupted: its run dir."""
    return _reference(tmp_path_factory.mktemp("full-reference"), FULL_FSDP)


@pytest.fixture(scope="session")
def fsdp_lora_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FSDP2 + LoRA (seed 000's setup), never interrupted, every full checkpoint kept."""
    return _reference(tmp_path_factory.mktemp("fsdp-lora-reference"), [*LORA_FSDP, "checkpoint.keep_last=6"])


@pytest.fixture(scope="session")
def moe_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-moe (seed 000 in miniature): FSDP2 + LoRA on attention and routed experts, never
    interrupted, every full checkpoint kept: its run dir."""
    out = tmp_path_factory.mktemp("moe-reference")
    assert_ok(trainyard(*train_args(out, *LORA_FSDP, "checkpoint.keep_last=6", config=TINY_MOE)))
    return out / "tiny-moe"

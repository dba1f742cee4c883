"""2-rank runs (torchrun, gloo) of the tiny model with `model.gradient_checkpointing=selective`: DDP + LoRA and
FSDP2 full fine-tuning follow the run without checkpointing step for step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TINY, events, train_in
from tests.world import World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

STEPS = 4
COMMON = [
    f"train.max_steps={STEPS}",
    "train.micro_batch_size=8",
    "train.global_batch_size=16",
    "train.lr=3e-3",
    "train.precision=fp32",
    "log.every_steps=1",
    "eval.every_steps=0",
    "eval.at_end=false",
    "checkpoint.at_end=false",
    "log.tensorboard=false",
]


def trajectory(world: World, out: Path, *overrides: str) -> tuple[list[float], list[float]]:
    train_in(world, TINY, f"output_dir={out}", *COMMON, *overrides)
    steps = events(out / "tiny", "train")
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    return [e["loss"] for e in steps], [e["grad_norm"] for e in steps]


@pytest.mark.parametrize(
    "setup", [["lora.enabled=true", "dist.strategy=ddp"], ["lora.enabled=false", "dist.strategy=fsdp"]],
    ids=["ddp-lora", "fsdp-full"],
)
def test_selective_checkpointing_follows_the_run_without(world: World, tmp_path: Path, setup: list[str]) -> None:
    """Recomputing the same fp32 ops in the same order changes no bit in principle; 1e-6 leaves room for
    nothing but a reduction reordered, while a gradient lost in the recompute moves step 2 on."""
    want = trajectory(world, tmp_path / "off", *setup, "model.gradient_checkpointing=false")
    got = trajectory(world, tmp_path / "selective", *setup, "model.gradient_checkpointing=selective")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    for rank in (0, 1):
        log = (tmp_path / "selective" / "tiny" / "logs" / f"rank-{rank}.log").read_text()
        assert "activation checkpointing: selective" in log

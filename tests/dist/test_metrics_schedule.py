"""The learning rates a real run used, step by step: warmup from lr/warmup, the peak at the end of
warmup, cosine down to lr·min_lr_ratio at the last step, and the logged lr is the one used."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import events, run_script
from tests.world import World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

LR, WARMUP, STEPS, MIN_RATIO = 1e-3, 3, 10, 0.1


def expected_lr(step: int) -> float:
    """Step counts from 1: linear warmup to the peak at step WARMUP, then cosine from the peak to
    the minimum over steps WARMUP+1 .. STEPS."""
    if step <= WARMUP:
        return LR * step / WARMUP
    progress = (step - WARMUP - 1) / (STEPS - WARMUP - 1)
    return LR * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_learning_rates_the_loop_used(solo: World, tmp_path: Path, schedule: str) -> None:
    used_file = tmp_path / "used.json"
    overrides = [
        f"train.max_steps={STEPS}", f"train.warmup_steps={WARMUP}", f"train.lr={LR}", f"train.min_lr_ratio={MIN_RATIO}",
        f"train.schedule={schedule}", "log.every_steps=1", "dist.strategy=none", "eval.every_steps=0",
        "eval.at_end=false", "checkpoint.at_end=false", "log.tensorboard=false", "log.progress=false",
    ]
    run_script(solo, "record_used_lr", str(tmp_path), str(used_file), *overrides)
    used = json.loads(used_file.read_text())
    logged = {e["step"]: e["lr"] for e in events(tmp_path / "tiny", "train")}
    assert len(used) == STEPS
    assert [logged[s] for s in range(1, STEPS + 1)] == pytest.approx(used, rel=1e-12)
    assert used[0] == pytest.approx(LR / WARMUP)
    assert used[WARMUP - 1] == pytest.approx(LR) and max(used) == pytest.approx(LR)
    assert used[-1] == pytest.approx(LR * MIN_RATIO)
    assert all(a >= b for a, b in zip(used[WARMUP:], used[WARMUP + 1:]))
    if schedule == "cosine":
        assert used == pytest.approx([expected_lr(s) for s in range(1, STEPS + 1)])

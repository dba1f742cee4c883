"""When a timed full checkpoint is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_ok, events, trainyard
from tests.dist.checkpoint_helpers import LORA_DDP, train_args
from trainyard.checkpoint import committed

pytestmark = pytest.mark.dist

STEPS = 6


@pytest.fixture(scope="module")
def timed_lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LoRA on the tiny model, saving by the clock only: a minute's millionth passes during
    any step, so a full checkpoint is due at every step boundary."""
    out = tmp_path_factory.mktemp("timed")
    timed = ["checkpoint.every_steps=0", "checkpoint.every_minutes=0.000001", "checkpoint.keep_last=100"]
    assert_ok(trainyard(*train_args(out, *LORA_DDP, f"train.max_steps={STEPS}", *timed)))
    return out / "tiny"


def test_checkpoint_every_minutes_commits_full_checkpoints_mid_run(timed_lora_run: Path) -> None:
    checkpoints = timed_lora_run / "checkpoints"
    mid_run = [int(p.name[5:]) for p in committed(checkpoints) if int(p.name[5:]) < STEPS]
    assert mid_run, [p.name for p in committed(checkpoints)]
    reported = {e["step"] for e in events(timed_lora_run, "checkpoint") if e.get("committed")}
    assert set(mid_run) <= reported and STEPS in reported


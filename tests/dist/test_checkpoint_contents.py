"""What a full checkpoint holds, and when a timed one is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.conftest import TINY, events, train_in, trainyard
from tests.dist.checkpoint_helpers import COMMON, LORA_DDP, train_args
from tests.world import World
from trainyard.checkpoint.save import committed, step_dir

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

STEPS = 6


@pytest.fixture(scope="module")
def timed_lora_run(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LoRA on the tiny model (tied embeddings), saving by the clock only: a minute's millionth
    passes during any step, so a full checkpoint is due at every step boundary."""
    out = tmp_path_factory.mktemp("timed")
    timed = ["checkpoint.every_steps=0", "checkpoint.every_minutes=0.000001", "checkpoint.keep_last=100"]
    train_in(world, TINY, f"output_dir={out}", *COMMON, *LORA_DDP, f"train.max_steps={STEPS}", *timed)
    return out / "tiny"


def test_checkpoint_every_minutes_commits_full_checkpoints_mid_run(timed_lora_run: Path) -> None:
    checkpoints = timed_lora_run / "checkpoints"
    mid_run = [int(p.name[5:]) for p in committed(checkpoints) if int(p.name[5:]) < STEPS]
    assert mid_run, [p.name for p in committed(checkpoints)]
    reported = {e["step"] for e in events(timed_lora_run, "checkpoint") if e.get("committed")}
    assert set(mid_run) <= reported and STEPS in reported


def test_lora_full_checkpoint_holds_no_frozen_weight_not_even_the_tied_lm_head(timed_lora_run: Path) -> None:
    """tie_word_embeddings: lm_head.weight is embed_tokens.weight, frozen under LoRA. It was
    stored under its second name (113 of SmolLM2's 195 MB); the base weights come from the model."""
    metadata = FileSystemReader(str(step_dir(timed_lora_run / "checkpoints", STEPS))).read_metadata()
    model_keys = [key for key in metadata.state_dict_metadata if key.startswith("model.")]
    assert model_keys and all("lora_" in key for key in model_keys), [k for k in model_keys if "lora_" not in k]
    assert not [key for key in metadata.state_dict_metadata if "lm_head" in key or "embed_tokens" in key]

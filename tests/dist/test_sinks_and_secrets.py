"""Every sink writes real files, and no file a run writes carries a secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, assert_ok, events, trainyard

pytestmark = pytest.mark.dist

PLANTED = {
    "HF_TOKEN": "hf_PLANTEDtoken0123456789",
    "WANDB_API_KEY": "PLANTEDwandbkey0123456789abcdef0123456789",
    "MY_SERVICE_PASSWORD": "PLANTEDpassw0rd!",
}


def test_tensorboard_and_wandb_offline_and_no_secret_anywhere(tmp_path: Path) -> None:
    secret_dir = tmp_path / PLANTED["HF_TOKEN"]  # a secret value even inside a path the config names
    result = trainyard(
        "train", TINY, f"output_dir={tmp_path}", "train.max_steps=6", "log.every_steps=2", "eval.every_steps=3",
        "log.wandb=true", f"data.cache_dir={secret_dir}", "--nproc", "2",
        env={**PLANTED, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert_ok(result)
    run_dir = tmp_path / "tiny"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    losses = [event.value for event in accumulator.Scalars("train/loss")]
    assert [event.step for event in accumulator.Scalars("train/loss")] == [2, 4, 6]
    assert losses == pytest.approx([e["loss"] for e in events(run_dir, "train")], rel=1e-6)
    assert "eval/eval_loss" in accumulator.Tags()["scalars"]
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")), "no offline W&B run"

    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(written) > 10
    for path in written:
        data = path.read_bytes()
        for value in PLANTED.values():
            assert value.encode() not in data, f"{value} leaked into {path}"
    for stream in (result.stdout, result.stderr):
        unwrapped = stream.replace("\n", "")
        for value in PLANTED.values():
            assert value not in unwrapped

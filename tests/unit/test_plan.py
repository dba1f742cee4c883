"""Learning-rate schedules, the auto strategy rule, and the checkpoint policy a job gets."""

from __future__ import annotations

import math

import pytest
import torch

from trainyard.config_file import load_config
from trainyard.dist import DistInfo
from trainyard.plan import checkpoint_policy, choose_strategy, replicated_state_bytes
from trainyard.train.optim import lr_lambda


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_then_schedule(schedule: str) -> None:
    cfg = load_config(
        "tiny", ["train.max_steps=11", "train.warmup_steps=2", f"train.schedule={schedule}", "train.min_lr_ratio=0.1"]
    )
    factor = lr_lambda(cfg)
    assert factor(0) == pytest.approx(0.5) and factor(1) == pytest.approx(1.0)
    assert factor(2) == pytest.approx(1.0)
    expected_end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[schedule]
    assert factor(10) == pytest.approx(expected_end)  # the last of 11 steps reaches the minimum
    assert factor(11) == pytest.approx(expected_end)
    if schedule == "cosine":
        assert factor(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (4 / 8))))


def _info(world: int) -> DistInfo:
    return DistInfo(0, world, 0, world, torch.device("cpu"), None)


def test_auto_picks_none_alone_ddp_when_it_fits() -> None:
    model = torch.nn.Linear(10, 10)
    assert choose_strategy("auto", model, _info(1)) == "none"
    assert choose_strategy("auto", model, _info(2)) == "ddp"
    assert choose_strategy("fsdp", model, _info(1)) == "none"


def test_replicated_state_counts_adam_only_for_trainable() -> None:
    model = torch.nn.Linear(100, 100, bias=False)  # 10,000 fp32 parameters
    assert replicated_state_bytes(model) == 10_000 * (4 + 4 + 8)
    model.weight.requires_grad_(False)
    assert replicated_state_bytes(model) == 10_000 * 4


def test_auto_picks_fsdp_when_replicated_state_exceeds_half_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainyard.plan as plan

    model = torch.nn.Linear(100, 100, bias=False)
    monkeypatch.setattr(plan, "device_memory_bytes", lambda info: 2 * replicated_state_bytes(model) - 1)
    assert choose_strategy("auto", model, _info(2)) == "fsdp"
    monkeypatch.setattr(plan, "device_memory_bytes", lambda info: 2 * replicated_state_bytes(model))
    assert choose_strategy("auto", model, _info(2)) == "ddp"


@pytest.mark.parametrize("preset", ["tiny", "quickstart"])
def test_a_job_that_sets_nothing_saves_full_checkpoints_every_30_minutes_and_at_the_end(preset: str) -> None:
    """A node lost at hour 67 loses at most half an hour, not the whole run."""
    cfg = load_config(preset)
    assert cfg.checkpoint.every_minutes == 30 and cfg.checkpoint.at_end
    assert checkpoint_policy(cfg).startswith("full every 30 min, at the end")
    off = load_config(preset, ["checkpoint.every_minutes=0", "checkpoint.at_end=false"])
    assert checkpoint_policy(off).startswith("full never")

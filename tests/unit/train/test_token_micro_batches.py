"""train.micro_batch_tokens in training: the same optimizer step as micro_batch_size rows on the same rows (loss and
gradient, normalised by the step's target tokens), a real run of the tiny job whose micro-batches hold up to N tokens
and whose losses are the row path's, and auto resolved on this machine before the sampler counts anything."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY
from tests.unit.data.test_token_batches import ACCUM, MICRO, PAD, dataset, sampler
from tests.unit.test_loss import tiny_llama
from trainyard.config import JobConfig
from trainyard.config_file import load_config
from trainyard.data import micro_batches
from trainyard.data.token_batches import Window, accumulation_windows, token_windows
from trainyard.dist import DistInfo
from trainyard.objective import Sft
from trainyard.train import build
from trainyard.train import recipe as trainer


def step_of(windows: Iterator[Window]) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The loop's step on one window: each micro-batch's loss sum over the step's targets, backward; the micro-batches
    it took."""
    model, objective, window = tiny_llama(), Sft(), next(windows)
    targets = sum(objective.count(batch) for batch in window)
    total = torch.zeros((), dtype=torch.float64)
    for batch in window:
        loss_sum = objective.loss_sum(model, batch, torch.device("cpu"))
        (loss_sum / targets).backward()
        total += loss_sum.detach().double()
    return total / targets, [p.grad for p in model.parameters()], len(window)


def test_the_step_s_loss_and_gradient_are_the_row_path_s() -> None:
    data = dataset()
    rows = accumulation_windows(micro_batches(data, sampler(), MICRO, PAD), ACCUM)
    tokens = token_windows(data, sampler(), MICRO * ACCUM, 100, PAD)
    for _ in range(2):
        (loss, grads, passes), (want, want_grads, row_passes) = step_of(tokens), step_of(rows)
        assert passes != row_passes  # the rows were cut otherwise
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _tiny(tmp_path: Path, name: str, *more: str) -> JobConfig:
    return load_config(TINY, [
        f"output_dir={tmp_path}", f"run_name={name}", "dist.strategy=none", "eval.every_steps=0", "eval.at_end=false",
        "checkpoint.at_end=false", "checkpoint.every_minutes=0", "checkpoint.preemption_signals=[]",
        "log.tensorboard=false", "log.every_steps=1", "train.max_steps=2", "train.micro_batch_size=4",
        "train.global_batch_size=16", "data.synthetic_train_size=48", "train.precision=fp32", *more])


def test_a_real_run_trains_token_bounded_micro_batches_with_the_row_path_s_losses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_RECORD_SAMPLES", "1")
    rows = trainer.run(_tiny(tmp_path, "rows"))
    tokens = trainer.run(_tiny(tmp_path, "tokens", "train.micro_batch_tokens=300"))
    assert tokens["steps"] == rows["steps"] == 2 and tokens["tokens"] == rows["tokens"]
    assert tokens["first_train_loss"] == pytest.approx(rows["first_train_loss"], rel=1e-5)
    assert tokens["final_train_loss"] == pytest.approx(rows["final_train_loss"], rel=1e-5)  # the same update
    record = [json.loads(line) for line in (tmp_path / "tokens" / "samples" / "rank-0.jsonl").read_text().splitlines()]
    groups = [line["rows"] for line in record if "rows" in line]
    assert sum(len(g) for g in groups) == 2 * 16  # each step's 16 rows, once
    assert len(groups) != 2 * 4 and any(len(g) != 4 for g in groups)  # not micro_batch_size rows at a time
    straight = [json.loads(line) for line in (tmp_path / "rows" / "samples" / "rank-0.jsonl").read_text().splitlines()]
    assert [r for g in groups for r in g] == [r for line in straight if "rows" in line for r in line["rows"]]


def test_train_resolves_auto_before_the_sampler_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(TINY, ["train.micro_batch_tokens=auto", "dist.strategy=none"])
    info = DistInfo(0, 1, 0, 1, torch.device("cpu"), None)
    with caplog.at_level(logging.INFO, logger="trainyard"):
        planned = build.planned_context(cfg, info, None)
    assert planned.train.micro_batch_tokens == 8 * 104  # the rows unread: micro_batch_size rows of max_length
    assert "train.micro_batch_tokens auto -> 832: " in caplog.text
    assert "a CPU gains nothing from larger micro-batches" in caplog.text

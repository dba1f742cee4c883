"""A step skipped for a non-finite loss leaves no trace in the figures: metrics.jsonl stays strict
JSON, and the interval holding the skipped step reports the loss and tokens of the others only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY, train_in
from tests.world import World

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

JOB = [
    "train.max_steps=8", "train.on_nonfinite=skip", "eval.every_steps=0", "eval.at_end=false",
    "checkpoint.at_end=false", "log.tensorboard=false", "log.progress=false",
]
FAULT = {"TRAINYARD_FAULT": "nan@rank1:step3"}


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every line of metrics.jsonl through a parser that refuses NaN and Infinity."""
    return [json.loads(line, parse_constant=_reject) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(world: World, out: Path, every: int, env: dict[str, str]) -> list[dict[str, Any]]:
    train_in(world, TINY, f"output_dir={out}", *JOB, f"log.every_steps={every}", env=env)
    return strict_events(out / "tiny")


@pytest.fixture(scope="module")
def runs(world: World, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("nonfinite")
    return {
        "clean": run(world, root / "clean", 1, {}),
        "fine": run(world, root / "fine", 1, FAULT),
        "coarse": run(world, root / "coarse", 4, FAULT),
    }


def train(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in events if e["kind"] == "train"}


def test_the_skipped_step_is_reported_and_leaves_no_train_event(runs: dict[str, list[dict[str, Any]]]) -> None:
    for name in ("fine", "coarse"):
        skipped = [e for e in runs[name] if e.get("event") == "skipped_nonfinite_step"]
        assert [(e["step"], e["ranks"]) for e in skipped] == [(3, [1])]
    assert sorted(train(runs["fine"])) == [1, 2, 4, 5, 6, 7, 8]
    assert sorted(train(runs["coarse"])) == [4, 8]


def test_interval_with_the_skipped_step_averages_the_trained_steps_only(runs: dict[str, list[dict[str, Any]]]) -> None:
    fine, coarse = train(runs["fine"]), train(runs["coarse"])
    trained = [1, 2, 4]
    targets = sum(fine[s]["target_tokens"] for s in trained)
    expected = sum(fine[s]["loss"] * fine[s]["target_tokens"] for s in trained) / targets
    assert coarse[4]["target_tokens"] == targets
    assert coarse[4]["loss"] == pytest.approx(expected, rel=1e-6)
    for figure in ("tokens_per_s", "data_wait_share", "comm_share", "grad_norm"):
        assert isinstance(coarse[4][figure], float), figure


def test_tokens_exclude_the_skipped_window(runs: dict[str, list[dict[str, Any]]]) -> None:
    clean, fine, coarse = train(runs["clean"]), train(runs["fine"]), train(runs["coarse"])
    window_3 = clean[3]["tokens"] - clean[2]["tokens"]  # the data of step 3 does not depend on the weights
    assert window_3 > 0
    assert fine[4]["tokens"] == clean[4]["tokens"] - window_3
    assert coarse[4]["tokens"] == clean[4]["tokens"] - window_3
    assert coarse[8]["tokens"] == clean[8]["tokens"] - window_3
    assert fine[4]["target_tokens"] == clean[4]["target_tokens"]

"""The worst batch first (seed 004: an out-of-memory error at hour 10 is a lost night): the first optimizer step
trains the epoch's largest rows on every rank, then the sampler's order resumes; an out-of-memory error says which
batch it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY, train_in, trainyard
from tests.world import World
from trainyard.config_file import load_config
from trainyard.data import ResumableSampler, prepare_datasets
from trainyard.model import source as source_room

pytestmark = pytest.mark.dist

RUN = ["train.max_steps=2", "log.progress=false", "log.tensorboard=false", "eval.every_steps=0",
       "eval.at_end=false", "checkpoint.at_end=false"]


def first_step_rows(run_dir: Path, ranks: int) -> list[int]:
    """The dataset rows every rank read for step 1 (one micro-batch each: tiny's accumulation is 1)."""
    rows = []
    for rank in range(ranks):
        lines = [json.loads(line) for line in (run_dir / "samples" / f"rank-{rank}.jsonl").read_text().splitlines()]
        rows += [index for _, _, index in next(line for line in lines if "rows" in line)["rows"]]
    return rows


def test_the_first_step_trains_the_largest_rows_then_the_seeds_order(world: World, tmp_path: Path) -> None:
    cfg = load_config(TINY)
    data = prepare_datasets(cfg.data, source_room.load_tokenizer(cfg.model, None), tmp_path / "cache")
    lengths = [len(ids) for ids in data.train["input_ids"]]
    record = {"TRAINYARD_RECORD_SAMPLES": "1"}
    train_in(world, TINY, f"output_dir={tmp_path / 'on'}", *RUN, env=record)
    train_in(world, TINY, f"output_dir={tmp_path / 'off'}", *RUN, "train.worst_batch_first=false", env=record)

    first = first_step_rows(tmp_path / "on" / "tiny", 2)
    assert len(first) == 2 * cfg.train.micro_batch_size
    rest = [n for i, n in enumerate(lengths) if i not in first]
    assert min(lengths[i] for i in first) >= max(rest), "a row left for later is longer than one of step 1's"
    plain = ResumableSampler(len(lengths), seed=cfg.train.seed, rank=0, world_size=1).epoch_order(0)
    assert sorted(first_step_rows(tmp_path / "off" / "tiny", 2)) == sorted(plain[: len(first)])


def test_out_of_memory_names_the_step_and_its_batch(tmp_path: Path) -> None:
    result = trainyard("train", TINY, f"output_dir={tmp_path}", *RUN, env={"TRAINYARD_FAULT": "oom@rank0:step1"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "out of memory at step 1 on rank 0" in result.stderr
    assert "train.worst_batch_first" in result.stderr and "train.micro_batch_size" in result.stderr
    assert "Traceback" not in result.stderr

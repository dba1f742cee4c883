"""data.balance_ranks (on by default) on 2 gloo ranks under DDP: rows that the stream's round robin would give one
rank all the long ones of a step are dealt by their tokens instead, so no rank holds much more than its peer; each
step trains the same rows in all, so the losses and gradient norms are the round robin's. Under a token budget the
dealt step needs fewer micro-batches than the round robin's [4, 4, 4]."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TINY, events, train_in
from tests.dist.test_token_micro_batches import BUDGET, JOB, STEPS, uneven_rows
from tests.world import World
from trainyard.config_file import load_config
from trainyard.data import prepare_datasets
from trainyard.model import source as source_room

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

ROBIN = "data.balance_ranks=false"


def step_rows(run_dir: Path, rank: int) -> list[list[int]]:
    """The rows (dataset indices) `rank` trained each step: its sample record's 2 micro-batches a step."""
    lines = [json.loads(line) for line in (run_dir / "samples" / f"rank-{rank}.jsonl").read_text().splitlines()]
    batches = [[index for _, _, index in line["rows"]] for line in lines if "rows" in line]
    return [batches[2 * step] + batches[2 * step + 1] for step in range(STEPS)]


def test_rows_dealt_by_tokens_train_the_round_robin_s_steps(world: World, tmp_path: Path) -> None:
    data = uneven_rows(tmp_path, load_config(TINY).train.seed)
    job = [f"data.path={data}", *(o for o in JOB if o != ROBIN), "dist.strategy=ddp"]
    record = {"TRAINYARD_RECORD_SAMPLES": "1"}
    train_in(world, TINY, f"output_dir={tmp_path / 'robin'}", *job, ROBIN, env=record)
    train_in(world, TINY, f"output_dir={tmp_path / 'dealt'}", *job, env=record)
    train_in(world, TINY, f"output_dir={tmp_path / 'tokens'}", *job, f"train.micro_batch_tokens={BUDGET}")
    robin_dir, dealt_dir, tokens_dir = (tmp_path / name / "tiny" for name in ("robin", "dealt", "tokens"))

    cfg = load_config(TINY, job)
    prepared = prepare_datasets(cfg.data, source_room.load_tokenizer(cfg.model, None), tmp_path / "cache")
    lengths = [len(ids) for ids in prepared.train["input_ids"]]
    robin, dealt = ([step_rows(run_dir, rank) for rank in (0, 1)] for run_dir in (robin_dir, dealt_dir))
    for step in range(STEPS):
        assert sorted(robin[0][step] + robin[1][step]) == sorted(dealt[0][step] + dealt[1][step])
        most_robin, most_dealt = (max(sum(lengths[i] for i in ranks[r][step]) for r in (0, 1)) for ranks in
                                  (robin, dealt))
        assert most_dealt < 0.7 * most_robin, (step, most_dealt, most_robin)

    want = events(robin_dir, "train")
    for got in (events(dealt_dir, "train"), events(tokens_dir, "train")):
        assert [e["step"] for e in got] == [e["step"] for e in want] == list(range(1, STEPS + 1))
        np.testing.assert_allclose([e["loss"] for e in got], [e["loss"] for e in want], rtol=2e-4, atol=1e-5)
        np.testing.assert_allclose([e["grad_norm"] for e in got], [e["grad_norm"] for e in want], rtol=1e-3,
                                   atol=1e-6)
    ran = [e["micro_batches_per_step"] for e in events(tokens_dir, "train")]
    assert sum(ran) < 3 * 4, ran  # the round robin's tokens path runs [4, 4, 4] (test_token_micro_batches.py)

"""train.micro_batch_tokens on 2 gloo ranks, DDP and FSDP2: rows of very different lengths make the ranks need
different counts of token-bounded micro-batches per step, yet each rank runs the count of the rank needing the most
(data.token_batches.step_count, from the sampler's stream without a collective), so FSDP2's gathers and DDP's one
synced backward pair up and no rank waits on a peer; the losses and gradient norms are the row path's on the same
global batch; summary.json and the train events say the budget and the micro-batches each step ran, and `trainyard
status` and `report` read that run."""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TINY, events, run_cli, train_in
from tests.world import World
from trainyard.config_file import load_config
from trainyard.data import ResumableSampler, prepare_datasets
from trainyard.data.token_batches import token_groups
from trainyard.model import source as source_room

pytestmark = [pytest.mark.dist, pytest.mark.worlds]

STEPS, ROWS, BUDGET = 3, 8, 480  # 8 rows per rank per step: 4 x 2 accumulation on the row path
JOB = [f"train.max_steps={STEPS}", "train.micro_batch_size=4", "train.global_batch_size=16", "data.max_length=256",
       "train.precision=fp32", "log.every_steps=1", "log.tensorboard=false", "log.progress=false",
       "eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false", "checkpoint.every_minutes=0",
       "train.worst_batch_first=false",  # the sampler's order from step 1, as uneven_rows deals it
       "data.balance_ranks=false"]  # the stream's round robin: test_balance_ranks.py deals the same rows by tokens
STRATEGIES = {"ddp": ["dist.strategy=ddp"], "fsdp": ["dist.strategy=fsdp"]}


def uneven_rows(folder: Path, seed: int) -> Path:
    """48 rows of about 44 tokens, but about 200 where the sampler deals them to rank 1 at steps 1 and 3 and to rank
    0 at step 2: a rank dealt short rows packs its 8 into fewer micro-batches of BUDGET tokens than its peer."""
    dealt = [list(islice(iter(ResumableSampler(48, seed=seed, rank=rank, world_size=2)), STEPS * ROWS))
             for rank in (0, 1)]
    long = {index for step, rank in ((0, 1), (1, 0), (2, 1)) for index in dealt[rank][step * ROWS : (step + 1) * ROWS]}
    rng = random.Random(7)
    path = folder / "uneven.jsonl"
    path.write_text("".join(
        json.dumps({"instruction": "Repeat.", "input": "", "output": "x" * rng.randint(150, 200) if i in long else "x"})
        + "\n" for i in range(48)))
    return path


def steps_of(run_dir: Path, rank: int) -> list[list[list[int]]]:
    """Each step's micro-batches on `rank` as the rows (dataset indices) they held, from its sample record."""
    lines = [json.loads(line) for line in (run_dir / "samples" / f"rank-{rank}.jsonl").read_text().splitlines()]
    steps: list[list[list[int]]] = [[]]
    for line in (line for line in lines if "rows" in line):
        if sum(len(group) for group in steps[-1]) == ROWS:
            steps.append([])
        steps[-1].append([index for _, _, index in line["rows"]])
    return steps


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_ranks_needing_different_micro_batch_counts_train_the_row_path_s_steps(
        world: World, tmp_path: Path, strategy: str) -> None:
    data = uneven_rows(tmp_path, load_config(TINY).train.seed)
    job, record = [f"data.path={data}", *JOB, *STRATEGIES[strategy]], {"TRAINYARD_RECORD_SAMPLES": "1"}
    train_in(world, TINY, f"output_dir={tmp_path / 'rows'}", *job, env=record)
    train_in(world, TINY, f"output_dir={tmp_path / 'tokens'}", *job, f"train.micro_batch_tokens={BUDGET}", env=record)
    rows_dir, tokens_dir = tmp_path / "rows" / "tiny", tmp_path / "tokens" / "tiny"

    cfg = load_config(TINY, job)
    prepared = prepare_datasets(cfg.data, source_room.load_tokenizer(cfg.model, None), tmp_path / "cache")
    lengths = [len(ids) for ids in prepared.train["input_ids"]]
    ranks = [steps_of(tokens_dir, rank) for rank in (0, 1)]
    ran = [len(step) for step in ranks[0]]
    assert [len(step) for step in ranks[1]] == ran and len(ran) == STEPS  # as many on both ranks, every step
    needed = [[len(token_groups([lengths[r] for group in step for r in group], BUDGET)) for step in steps]
              for steps in ranks]
    assert needed == [[1, 4, 1], [4, 1, 4]], needed  # a rank's short rows pack into fewer micro-batches
    assert ran == [max(pair) for pair in zip(*needed, strict=True)]
    for steps in ranks:
        assert all(sum(lengths[r] for r in group) <= BUDGET or len(group) == 1 for step in steps for group in step)
    assert [[r for group in step for r in group] for step in steps_of(rows_dir, 0)] == \
        [[r for group in step for r in group] for step in ranks[0]]  # the row path's rows, in its order

    got, want = events(tokens_dir, "train"), events(rows_dir, "train")
    assert [e["step"] for e in got] == [e["step"] for e in want] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([e["loss"] for e in got], [e["loss"] for e in want], rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose([e["grad_norm"] for e in got], [e["grad_norm"] for e in want], rtol=1e-3, atol=1e-6)
    assert [(e["micro_batch_tokens"], e["micro_batches_per_step"]) for e in got] == [(BUDGET, n) for n in ran]
    assert [e["micro_batches_per_step"] for e in want] == [2] * STEPS and "micro_batch_tokens" not in want[0]

    summary = json.loads((tokens_dir / "summary.json").read_text())
    assert summary["accumulation"] is None and summary["micro_batch_tokens"] == BUDGET
    assert summary["micro_batches_per_step"] == {"mean": round(sum(ran) / STEPS, 3), "min": min(ran), "max": max(ran)}
    assert json.loads((rows_dir / "summary.json").read_text())["micro_batches_per_step"] == \
        {"mean": 2, "min": 2, "max": 2}
    logged = (tokens_dir / "logs" / "rank-0.log").read_text()
    assert f"each step's {ROWS} rows per rank (about " in logged  # the plan, as the dry run says it
    assert f"ran each step's {ROWS} rows per rank in {ran[0]} micro-batch(es) of up to {BUDGET} tokens" in logged
    status = run_cli("status", str(tokens_dir), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["summary"]["micro_batches_per_step"] == summary["micro_batches_per_step"]
    report = run_cli("report", str(tokens_dir), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr

"""Restarts on another world size: 2 ranks, killed, 1 rank, killed, 2 ranks to the end.

The global batch stays the same (accumulation re-derived), and the rows the ranks record
(TRAINYARD_RECORD_SAMPLES) show every row of the epoch trained exactly once.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY, assert_ok, events, train_in, trainyard
from tests.dist.checkpoint_helpers import (
    COMMON,
    EVERY,
    LORA_DDP,
    STEPS,
    events_of_last_run,
    kill_tree,
    last_step,
    resumed_events,
    start,
    train_args,
)
from tests.world import World
from trainyard.checkpoint.save import latest_full

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 16  # train_args: micro-batches of 8, global_batch_size 16
ROWS = 200  # an epoch of 12.5 steps: step 13 takes the last 8 rows of epoch 0 and the first 8 of epoch 1


def saved_step(path: Path | None) -> int:
    return int(path.name[5:]) if path is not None else 0


def wait_for_checkpoint(proc: subprocess.Popen[str], checkpoints: Path, step: int, timeout: float = 300) -> int:
    """Until a committed full checkpoint of at least `step` exists; returns its step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = saved_step(latest_full(checkpoints))
        if found >= step:
            return found
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"run ended (exit {proc.returncode}) before checkpoint {step}:\n{err[-3000:]}")
        time.sleep(0.005)
    kill_tree(proc)
    raise AssertionError(f"no checkpoint {step} within {timeout}s")


def attempts(record: Path) -> list[tuple[dict[str, Any], list[list[int]]]]:
    """(start line, rows as [epoch, position, index]) for each start of the job, in order."""
    found: list[tuple[dict[str, Any], list[list[int]]]] = []
    for line in record.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by the kill: its step never finished
        if "start" in entry:
            found.append((entry, []))
        else:
            found[-1][1].extend(entry["rows"])
    return found


def test_two_ranks_then_one_then_two_train_every_row_of_the_epoch_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINYARD_RECORD_SAMPLES", "1")
    seed = random.randrange(1 << 30)
    print(f"kill steps drawn with seed {seed}")
    rng = random.Random(seed)
    overrides = [*LORA_DDP, f"data.synthetic_train_size={ROWS}"]
    run_dir, checkpoints = tmp_path / "tiny", tmp_path / "tiny" / "checkpoints"
    worlds = [2, 1, 2]

    resumed_at = [0]  # the step each segment starts after
    for world in worlds[:-1]:
        kill_at = min(resumed_at[-1] + EVERY * rng.randint(1, 2), STEPS - EVERY)
        print(f"world {world}: killed once checkpoint {kill_at} is committed")
        proc = start(train_args(tmp_path, *overrides, nproc=world))
        committed_step = wait_for_checkpoint(proc, checkpoints, kill_at)
        kill_tree(proc)
        assert proc.returncode == -signal.SIGKILL
        assert last_step(run_dir) < STEPS, "the run finished before the kill"
        resumed_at.append(saved_step(latest_full(checkpoints)))
        assert resumed_at[-1] >= committed_step
    assert_ok(trainyard(*train_args(tmp_path, *overrides, nproc=worlds[-1])))
    context = f"seed {seed}, segments resumed after steps {resumed_at}"

    resumed = resumed_events(run_dir)
    assert [e["step"] for e in resumed] == resumed_at[1:], context
    assert [e["saved_world_size"] for e in resumed] == worlds[:-1], context
    assert [e["accumulation"] for e in resumed] == [GLOBAL_BATCH // (8 * w) for w in worlds[1:]], context
    assert [e["step"] for e in events_of_last_run(run_dir, "train")] == list(range(resumed_at[-1] + 1, STEPS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"], summary["accumulation"]) == (STEPS, 2, 1), context

    # Each rank's attempts, matched to the segments it took part in.
    by_segment: dict[int, list[tuple[dict[str, Any], list[list[int]]]]] = {}
    for rank in range(max(worlds)):
        segments = [k for k, world in enumerate(worlds) if rank < world]
        found = attempts(run_dir / "samples" / f"rank-{rank}.jsonl")
        assert [start["world_size"] for start, _ in found] == [worlds[k] for k in segments], context
        for k, attempt in zip(segments, found, strict=True):
            by_segment.setdefault(k, []).append(attempt)

    trained: dict[int, int] = {}  # global stream position -> dataset index
    ends = [step * GLOBAL_BATCH for step in [*resumed_at[1:], STEPS]]
    for k, ranks in by_segment.items():
        for start_line, rows in ranks:
            first = start_line["start"]["epoch"] * ROWS + start_line["start"]["position"]
            assert start_line["samples_per_epoch"] == ROWS
            assert first == resumed_at[k] * GLOBAL_BATCH, (context, k, start_line)
            for epoch, position, index in rows:
                stream = epoch * ROWS + position
                if stream < ends[k]:  # later rows belong to steps the next segment trained again
                    assert stream not in trained, (context, k, stream)
                    trained[stream] = index
    assert sorted(trained) == list(range(STEPS * GLOBAL_BATCH)), context
    epoch0 = Counter(trained[p] for p in range(ROWS))
    assert sorted(epoch0) == list(range(ROWS)) and set(epoch0.values()) == {1}, context
    epoch1 = [trained[p] for p in range(ROWS, STEPS * GLOBAL_BATCH)]
    assert len(set(epoch1)) == len(epoch1), context


def test_a_world_size_that_cannot_keep_the_global_batch_exits_2_naming_those_that_can(
    world: World, tmp_path: Path
) -> None:
    """No global_batch_size: 2 ranks x micro 4 trained 8 samples per step, the checkpoint's global
    batch. 3 ranks cannot keep it (exit 2, sizes 1 and 2 named); 1 rank can, accumulating 2."""
    common = ["train.micro_batch_size=4", "train.global_batch_size=null", "checkpoint.every_steps=0"]
    train_in(world, TINY, f"output_dir={tmp_path}", *COMMON, *LORA_DDP, *common, "train.max_steps=2")
    run_dir = tmp_path / "tiny"
    config_before = (run_dir / "config.yaml").read_text()

    refused = trainyard(*train_args(tmp_path, *LORA_DDP, *common, "train.max_steps=4", nproc=3))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    message = " ".join(refused.stderr.split())  # the console wraps long lines
    assert "checkpoint's global batch of 8 samples" in message, message[-2000:]
    assert "world sizes that keep it: 1, 2" in message, message[-2000:]
    assert (run_dir / "config.yaml").read_text() == config_before, "a rejected resume rewrote config.yaml"

    assert_ok(trainyard(*train_args(tmp_path, *LORA_DDP, *common, "train.max_steps=4", nproc=1)))
    assert [(e["saved_world_size"], e["accumulation"]) for e in resumed_events(run_dir)] == [(2, 2)]
    assert [e["step"] for e in events(run_dir, "train")][-2:] == [3, 4]
    assert json.loads((run_dir / "summary.json").read_text())["accumulation"] == 2

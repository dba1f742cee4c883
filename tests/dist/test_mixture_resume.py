"""A pretraining mixture killed mid-run resumes its data stream exactly: the same token ids reach the model after
the resume as in the uninterrupted run, the final weights are bitwise equal, and on another world size no row is
skipped or repeated (compared by the digests of the token ids each rank fed the model)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import TINY, assert_ok, events, run_cli, train_in, trainyard
from tests.dist.checkpoint_helpers import (
    assert_same_tensors,
    kill_tree,
    model_tensors,
    resumed_events,
    start,
    wait_for_step,
)
from tests.world import World
from trainyard.checkpoint.save import latest_full, step_dir

pytestmark = pytest.mark.dist

STEPS, EVERY, ROW, MICRO = 12, 4, 64, 4
GLOBAL_TOKENS = 2 * MICRO * ROW  # accumulation 1 on 2 ranks, 2 on 1 rank


def write_job(tmp_path: Path) -> Path:
    """The tiny Llama on a 70/30 mixture of pydoc's help topics and a JSONL file of generated sentences."""
    rng = random.Random(0)
    words = "the a rank step token shard stream weight model loss data resume".split()
    lines = [json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(5, 40)))}) for _ in range(400)]
    (tmp_path / "sentences.jsonl").write_text("\n".join(lines) + "\n")
    job = yaml.safe_load(Path(TINY).read_text())
    job["data"] = {
        "mixture": [
            {"path": "builtin:pydoc-topics", "weight": 0.7},
            {"path": str(tmp_path / "sentences.jsonl"), "weight": 0.3},
        ],
        "max_length": ROW,
    }
    job["train"] = {
        "total_tokens": STEPS * GLOBAL_TOKENS, "global_batch_tokens": GLOBAL_TOKENS, "micro_batch_size": MICRO,
        "lr": 3e-3, "precision": "bf16-mixed",  # fp32 masters, bf16 compute: resumed bitwise on any CPU
    }
    job["eval"] = {"at_end": False}
    job["checkpoint"] = {"every_steps": EVERY, "keep_last": 2}
    job["log"] = {"every_steps": 1, "progress": False, "tensorboard": False}
    path = tmp_path / "mixture.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run_args(job: Path, out: Path, nproc: int) -> list[str]:
    return ["train", str(job), f"output_dir={out}", "--nproc", str(nproc)]


def attempts(run_dir: Path) -> list[tuple[int, dict[int, str]]]:
    """Per start of the job on any rank: (global row it started from, {global row: token digest} it drew)."""
    found: list[tuple[int, dict[int, str]]] = []
    for record in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        for line in record.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by the kill
            if "start" in entry:
                found.append((entry["start"]["row"], {}))
            else:
                found[-1][1].update({row: digest for row, _, digest in entry["rows"]})
    return found


def trained_rows(run_dir: Path, final_start: int) -> dict[int, str]:
    """{global row: digest} of what the model was fed in steps that count: rows before the final attempt's start
    from the earlier attempts, the rest from the final attempt (its ranks each recorded a start line)."""
    trained: dict[int, str] = {}
    for started, rows in attempts(run_dir):
        for row, digest in rows.items():
            if (started == final_start) == (row >= final_start):
                assert trained.setdefault(row, digest) == digest, f"row {row} fed twice with different tokens"
    return trained


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def test_sigkill_then_resume_feeds_the_same_tokens_ends_bitwise_equal_and_another_world_skips_nothing(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, draw_step
) -> None:
    monkeypatch.setenv("TRAINYARD_RECORD_SAMPLES", "1")
    job = write_job(tmp_path)
    # The shards, made once before any run; in this process: `prepare` forms no process group.
    assert_ok(run_cli("prepare", str(job), f"output_dir={tmp_path / 'reference'}"))
    reference = tmp_path / "reference" / "tiny"
    train_in(world, str(job), f"output_dir={tmp_path / 'reference'}", env={"TRAINYARD_RECORD_SAMPLES": "1"})
    want_rows = trained_rows(reference, 0)
    assert sorted(want_rows) == list(range(STEPS * GLOBAL_TOKENS // ROW))

    kill_at = draw_step(EVERY + 1, STEPS - 2)
    killed = tmp_path / "killed"
    proc = start(run_args(job, killed, 2))
    wait_for_step(proc, killed / "tiny", kill_at)
    kill_tree(proc)
    saved = latest_full(killed / "tiny" / "checkpoints")
    assert saved is not None, f"no committed checkpoint by step {kill_at}"
    shutil.copytree(killed, tmp_path / "elastic")

    assert_ok(trainyard(*run_args(job, killed, 2)))
    resumed_at = resumed_events(killed / "tiny")[-1]["step"]
    final_start = resumed_at * GLOBAL_TOKENS // ROW
    got_rows = trained_rows(killed / "tiny", final_start)
    assert got_rows == want_rows, f"killed at step {kill_at}, resumed after {resumed_at}"
    assert_same_tensors(
        model_tensors(step_dir(killed / "tiny" / "checkpoints", STEPS)),
        model_tensors(step_dir(reference / "checkpoints", STEPS)),
    )
    assert summary(killed / "tiny")["tokens_per_source"] == summary(reference)["tokens_per_source"]

    elastic = tmp_path / "elastic"
    assert_ok(trainyard(*run_args(job, elastic, 1)))
    elastic_resume = resumed_events(elastic / "tiny")[-1]
    assert (elastic_resume["saved_world_size"], elastic_resume["accumulation"]) == (2, 2)
    elastic_start = elastic_resume["step"] * GLOBAL_TOKENS // ROW
    assert trained_rows(elastic / "tiny", elastic_start) == want_rows  # every row once, the same tokens

    counts = summary(reference)["tokens_per_source"]
    entries = [json.loads(line) for record in (reference / "samples").glob("rank-*.jsonl")
               for line in record.read_text().splitlines()]
    sources = [row_source for entry in entries if "start" not in entry for _, row_source, _ in entry["rows"]]
    assert list(counts.values()) == [sources.count(0) * ROW, sources.count(1) * ROW]
    assert events(reference, "train")[-1]["tokens_per_source"] == counts


def test_a_source_that_runs_out_under_stop_ends_the_run_on_every_rank_at_the_last_full_step(
    world: World, tmp_path: Path
) -> None:
    """With an odd number of rows left, one rank can still fill its window and the other cannot: the step's vote
    ends the run on both, before that step, with a final checkpoint where the stream stands."""
    job = yaml.safe_load(write_job(tmp_path).read_text())
    lines = (tmp_path / "sentences.jsonl").read_text().splitlines()[:70]
    (tmp_path / "short.jsonl").write_text("\n".join(lines) + "\n")
    job["data"]["mixture"] = [{"path": str(tmp_path / "short.jsonl"), "weight": 1}]
    job["data"]["mixture_exhausted"] = "stop"
    job["train"]["total_tokens"] = 1000 * GLOBAL_TOKENS
    (tmp_path / "stop.yaml").write_text(yaml.safe_dump(job))
    train_in(world, str(tmp_path / "stop.yaml"), f"output_dir={tmp_path}")

    done = summary(tmp_path / "tiny")
    rows = done["data_stats"]["sources"][0]["tokens"] // ROW
    assert rows % (GLOBAL_TOKENS // ROW), "pick a source length that leaves a partial step"
    assert done["steps"] == rows // (GLOBAL_TOKENS // ROW)
    ended = [e for e in events(tmp_path / "tiny", "system") if e.get("event") == "data_exhausted"]
    assert [e["step"] for e in ended] == [done["steps"]]
    assert list(done["tokens_per_source"].values()) == [done["steps"] * GLOBAL_TOKENS]
    assert latest_full(tmp_path / "tiny" / "checkpoints") == step_dir(tmp_path / "tiny" / "checkpoints", done["steps"])

"""DiLoCo sites agree on stops only at the outer sync: a SIGTERM to the launcher stops every site right after
the round's sync step, saves a full checkpoint there, exits 75, and the same command resumes from it."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from tests.conftest import TINY, assert_ok, events, trainyard
from tests.dist.checkpoint_helpers import kill_tree, resumed_events, start, wait_for_step
from trainyard.checkpoint.save import latest_full, step_dir

pytestmark = pytest.mark.dist

SYNC_EVERY = 4
JOB = [
    "lora.enabled=false",
    "train.micro_batch_size=8",
    "log.every_steps=1",
    "log.progress=false",
    "log.tensorboard=false",
    "eval.every_steps=0",
    "eval.at_end=false",
    "train.precision=bf16-mixed",
    "dist.strategy=diloco",
    "diloco.groups=2",
    f"diloco.sync_every={SYNC_EVERY}",
    "checkpoint.every_steps=0",
    # An epoch of 128 steps: the positions compared below grow with the steps only until the data wraps (512 rows
    # wrapped at step 16 when the signal landed after step 8 under a loaded suite, and every position read 0).
    "data.synthetic_train_size=4096",
]
NOTICE = re.compile(r"trainyard: preempted by SIG\w+ after step (\d+); checkpoint step-(\d{8}) committed")


def test_sigterm_mid_round_stops_every_site_at_the_next_sync_then_resumes(tmp_path: Path) -> None:
    run_dir, checkpoints = tmp_path / "tiny", tmp_path / "tiny" / "checkpoints"
    base = ["train", TINY, f"output_dir={tmp_path}", *JOB]
    proc = start([*base, "train.max_steps=100000", "--nproc", "4"])
    try:
        signalled_after = wait_for_step(proc, run_dir, SYNC_EVERY + 1, timeout=120)
        proc.send_signal(signal.SIGTERM)  # the launcher only; it forwards to the agent and the workers
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.returncode is None:
            kill_tree(proc)
    assert proc.returncode == 75, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    notices = [NOTICE.search(line) for line in stderr.splitlines()]
    notices = [m for m in notices if m]
    assert len(notices) == 1, stderr[-4000:]
    step, saved = map(int, notices[0].groups())

    # Stopped at a sync step, not before the step the signal landed after, with the one full checkpoint there.
    assert step == saved and step % SYNC_EVERY == 0 and step >= signalled_after, (step, signalled_after)
    assert latest_full(checkpoints) == step_dir(checkpoints, step)
    assert (step_dir(checkpoints, step) / "COMMITTED").exists()
    assert [(e["step"], e["mode"]) for e in events(run_dir, "checkpoint")] == [(step, "full")]
    # The sync step was trained and logged (log.every_steps=1), nothing past it.
    assert max(e["step"] for e in events(run_dir, "train")) == step, "the stop step's train event is missing or late"
    syncs = [e["step"] for e in events(run_dir, "system") if e.get("event") == "outer_sync"]
    assert syncs == list(range(SYNC_EVERY, step + 1, SYNC_EVERY))
    # Every rank of both sites stood at that step: each wrote its own data position into the save, all the same.
    # (Heartbeats cannot show it: the 2 s beat thread does not write again when the loop leaves by preemption.)
    positions = _positions(step_dir(checkpoints, step))
    assert len(set(positions.values())) == 1 and positions[0] > 0, positions

    # The same command again (a short tail) resumes from that checkpoint and finishes.
    resumed = trainyard(*base, f"train.max_steps={step + SYNC_EVERY}", "--nproc", "4", timeout=180)
    assert_ok(resumed)
    assert [e["step"] for e in resumed_events(run_dir)] == [step]
    trained = [e["step"] for e in events(run_dir, "train")]
    assert trained[-SYNC_EVERY:] == list(range(step + 1, step + SYNC_EVERY + 1)), trained
    assert all(s <= step for s in trained[:-SYNC_EVERY]), trained
    assert latest_full(checkpoints) == step_dir(checkpoints, step + SYNC_EVERY)
    final = _positions(step_dir(checkpoints, step + SYNC_EVERY))
    # The stream moves the same amount each step, so the stop's position was exactly `step` steps in on every rank.
    assert {r: p * step for r, p in final.items()} == {r: p * (step + SYNC_EVERY) for r, p in positions.items()}


def _positions(step: Path) -> dict[int, int]:
    """Each rank's data position as that rank saved it (rank-<r>.json in a full checkpoint), in the first epoch."""
    samplers = [json.loads((step / f"rank-{r}.json").read_text())["sampler"] for r in range(4)]
    assert all(sampler["epoch"] == 0 for sampler in samplers), samplers
    return {r: sampler["position"] for r, sampler in enumerate(samplers)}

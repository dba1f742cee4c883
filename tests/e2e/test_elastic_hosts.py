"""`--nnodes 1:2` across two namespace hosts: a host dies and the other goes on alone, the host comes back and the
world grows again; the global batch is kept by accumulation and every row of an epoch is trained once."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import TINY
from tests.dist.checkpoint_helpers import events_of_last_run, last_step, resumed_events
from tests.dist.test_elastic_resume import attempts
from tests.e2e.test_multihost import HOST_ADDRESSES, Host, _kill_namespace_processes, finish, launch_on
from trainyard.checkpoint.save import latest_full

pytestmark = pytest.mark.e2e

ROWS, STEPS, GLOBAL_BATCH = 320, 80, 32  # 10 steps an epoch; micro-batches of 8: accumulation 1 on 4 ranks, 2 on 2
# STEPS: host A alone must still be training when host B is back (B's start, then its join stops A's workers: A
# trained 24-26 steps alone, in the suite and alone on 2 cores); every step after the world grew again only adds CPU.
JOB = [
    TINY, f"train.max_steps={STEPS}", "train.micro_batch_size=8", f"train.global_batch_size={GLOBAL_BATCH}",
    f"data.synthetic_train_size={ROWS}", "checkpoint.every_steps=4", "checkpoint.every_minutes=0",
    "checkpoint.keep_last=2", "checkpoint.at_end=false", "eval.every_steps=0", "eval.at_end=false",
    "log.every_steps=1", "log.progress=false", "log.tensorboard=false",
]
# last_call_timeout: how long a round that has MIN nodes waits for more; both hosts start together here.
ELASTIC = ["--nnodes", "1:2", "--rdzv", "c10d", "--rdzv-id", "grow", "--master", f"{HOST_ADDRESSES[0]}:29650",
           "--nproc", "2", "--max-restarts", "3", "--rdzv-conf", "last_call_timeout=10"]


def wait_for(what: str, check: object, node: subprocess.Popen[str], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        if node.poll() is not None:
            pytest.fail(f"host A's launch exited ({node.returncode}) before {what}:\n{node.communicate()[0][-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout} s")


def test_a_host_lost_then_back_shrinks_and_grows_the_world_training_every_row_once(
    hosts: tuple[Host, Host], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINYARD_RECORD_SAMPLES", "1")
    run_dir, checkpoints = tmp_path / "tiny", tmp_path / "tiny" / "checkpoints"
    job = [*JOB, f"output_dir={tmp_path}", *ELASTIC]
    head, other = (launch_on(host, tmp_path, *job, "--node-rank", str(rank)) for rank, host in enumerate(hosts))
    wait_for("a checkpoint", lambda: latest_full(checkpoints) is not None and last_step(run_dir) >= 5, head)
    _kill_namespace_processes(hosts[1].namespace)  # its launcher, agent and workers
    other.communicate(timeout=30)
    trained_before_kill = last_step(run_dir)

    wait_for("a resume on host A alone", lambda: len(resumed_events(run_dir)) == 1, head)
    other = launch_on(hosts[1], tmp_path, *job, "--node-rank", "1")  # the host is back: the world grows again
    outcomes = [finish(node, timeout=600) for node in (head, other)]
    for code, output in outcomes:
        assert code == 0, output[-4000:]

    resumed = resumed_events(run_dir)
    assert [(e["saved_world_size"], e["world_size"], e["accumulation"]) for e in resumed] == [(4, 2, 2), (2, 4, 1)]
    resumed_at = [0, *(e["step"] for e in resumed)]
    assert 0 < resumed_at[1] <= trained_before_kill < resumed_at[2] < STEPS, (resumed_at, trained_before_kill)
    assert [e["step"] for e in events_of_last_run(run_dir, "train")] == list(range(resumed_at[2] + 1, STEPS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"], summary["accumulation"]) == (STEPS, 4, 1)
    assert_every_row_trained_once(run_dir, [4, 2, 4], resumed_at)


def assert_every_row_trained_once(run_dir: Path, worlds: list[int], resumed_at: list[int]) -> None:
    """Each segment's rows up to the step the next one resumed from are the global stream's, once each; rows a
    segment read after its last checkpoint belong to steps the next one trained again."""
    trained: dict[int, int] = {}  # global stream position -> dataset index
    ends = [step * GLOBAL_BATCH for step in [*resumed_at[1:], STEPS]]
    for rank in range(max(worlds)):
        segments = [k for k, world in enumerate(worlds) if rank < world]
        found = attempts(run_dir / "samples" / f"rank-{rank}.jsonl")
        assert [start["world_size"] for start, _ in found] == [worlds[k] for k in segments], (rank, resumed_at)
        for k, (start, rows) in zip(segments, found, strict=True):
            assert start["start"]["epoch"] * ROWS + start["start"]["position"] == resumed_at[k] * GLOBAL_BATCH
            for epoch, position, index in rows:
                stream = epoch * ROWS + position
                if stream < ends[k]:
                    assert stream not in trained, (rank, k, stream)
                    trained[stream] = index
    assert sorted(trained) == list(range(STEPS * GLOBAL_BATCH)), resumed_at
    for epoch in range(STEPS * GLOBAL_BATCH // ROWS):
        assert sorted(trained[p] for p in range(epoch * ROWS, (epoch + 1) * ROWS)) == list(range(ROWS)), epoch

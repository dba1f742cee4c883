"""A save that cannot be written (full, lite, preemption, or the commit marker) stops every
rank with the dir named, or, with checkpoint.on_error=continue, is reported and skipped; the
previous checkpoint survives."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TINY, events, train_in, trainyard
from tests.dist.checkpoint_helpers import (
    COMMON,
    EVERY,
    FULL_FSDP,
    LORA_DDP,
    STEPS,
    kill_tree,
    start,
    train_args,
    wait_for_step,
)
from tests.world import World
from trainyard.checkpoint.save import MARKER, committed, latest_full, step_dir

pytestmark = pytest.mark.dist


def train_on(world: World, out: Path, *overrides: str) -> None:
    """A run that must succeed, on the shared world: the runs whose message or exit code a test reads are launched."""
    train_in(world, TINY, f"output_dir={out}", *COMMON, *overrides)


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def fill(folder: Path) -> None:
    """Leave not one free block."""
    with open(folder / "filler", "wb", buffering=0) as handle:
        try:
            while handle.write(b"\0" * 4096):
                pass
        except OSError:
            pass


@pytest.fixture
def tmpfs_checkpoints(tmp_path: Path) -> Iterator[Path]:
    """A small filesystem of its own mounted where the run keeps its checkpoints."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    target = tmp_path / "tiny" / "checkpoints"
    target.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(target)], capture_output=True, text=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


def test_full_disk_stops_naming_the_dir_or_continues_when_asked(
    world: World, tmp_path: Path, tmpfs_checkpoints: Path
) -> None:
    checkpoints = tmpfs_checkpoints
    train_on(world, tmp_path, *LORA_DDP, f"train.max_steps={EVERY}")
    first = step_dir(checkpoints, EVERY)
    before = digest(first)
    fill(checkpoints)

    stopped = trainyard(*train_args(tmp_path, *LORA_DDP))
    assert stopped.returncode != 0
    message = "".join(stopped.stderr.split())  # the console wraps long lines anywhere
    assert str(step_dir(checkpoints, 2 * EVERY)) in message and "Nospaceleftondevice" in message, stopped.stderr[-3000:]
    assert re.search(r"[\d,]+bytesfreeonitsfilesystem,thesaveneedsabout[\d,]+bytes", message), stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert latest_full(checkpoints) == first and committed(checkpoints) == [first]
    assert digest(first) == before

    train_on(world, tmp_path, *LORA_DDP, "checkpoint.on_error=continue")
    failed = [e["step"] for e in events(tmp_path / "tiny", "system") if e.get("event") == "checkpoint_failed"]
    assert failed[0] == 2 * EVERY and failed[-1] == STEPS, failed
    assert f'"steps": {STEPS}' in (tmp_path / "tiny" / "summary.json").read_text()
    assert latest_full(checkpoints) == first and digest(first) == before


def test_unwritable_checkpoint_dir_is_reported_and_skipped_with_on_error_continue(world: World, tmp_path: Path) -> None:
    """A file where a step folder must go: every rank's mkdir fails (chmod would not stop root)."""
    checkpoints = tmp_path / "tiny" / "checkpoints"
    checkpoints.mkdir(parents=True)
    blocked = step_dir(checkpoints, 2 * EVERY)
    blocked.write_text("not a folder")
    train_on(world, tmp_path, *FULL_FSDP, "checkpoint.on_error=continue", f"train.max_steps={3 * EVERY}")
    failures = [e for e in events(tmp_path / "tiny", "system") if e.get("event") == "checkpoint_failed"]
    assert [e["step"] for e in failures] == [2 * EVERY]
    assert str(blocked) in failures[0]["error"]
    assert [p.name for p in committed(checkpoints)] == [step_dir(checkpoints, s).name for s in (EVERY, 3 * EVERY)]
    assert blocked.read_text() == "not a folder"


LITE_ONLY = ["checkpoint.every_steps=0", f"checkpoint.lite_every_steps={EVERY}", "checkpoint.at_end=false"]


def test_a_lite_save_on_a_full_disk_stops_naming_the_dir_or_continues_when_asked(
    world: World, tmp_path: Path, tmpfs_checkpoints: Path
) -> None:
    checkpoints = tmpfs_checkpoints
    fill(checkpoints)
    short = [*LORA_DDP, *LITE_ONLY, f"train.max_steps={2 * EVERY}"]

    stopped = trainyard(*train_args(tmp_path, *short))
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    message = "".join(stopped.stderr.split())
    assert str(step_dir(checkpoints, EVERY)) in message and "Nospaceleftondevice" in message, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]

    train_on(world, tmp_path, *short, "checkpoint.on_error=continue")
    failed = [e["step"] for e in events(tmp_path / "tiny", "system") if e.get("event") == "checkpoint_failed"]
    assert failed == [EVERY, EVERY, 2 * EVERY], failed  # the stopped run's, then this run's two
    assert committed(checkpoints, "lite") == []


def test_a_failed_preemption_save_never_claims_a_committed_checkpoint(tmp_path: Path, tmpfs_checkpoints: Path) -> None:
    """on_error: continue keeps training through failed saves; a preemption still has to stop,
    and without a checkpoint it must not exit 75 ("committed, requeue me")."""
    checkpoints = tmpfs_checkpoints
    fill(checkpoints)
    proc = start(train_args(tmp_path, *LORA_DDP, "checkpoint.every_steps=0", "checkpoint.on_error=continue"))
    try:
        wait_for_step(proc, tmp_path / "tiny", EVERY)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.returncode is None:
            kill_tree(proc)
    message = " ".join(stderr.split())
    assert proc.returncode == 2, stderr[-3000:]
    assert "stopped by" in message and "could not be saved" in message, stderr[-3000:]
    assert "is committed" not in message, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert latest_full(checkpoints) is None and committed(checkpoints) == []


@pytest.fixture
def immutable_marker(tmp_path: Path) -> Iterator[Path]:
    """A lite checkpoint at step EVERY whose COMMITTED marker no one may replace (chattr +i
    stops root too): rank 0's commit of the full checkpoint at that step then fails."""
    path = step_dir(tmp_path / "tiny" / "checkpoints", EVERY)
    path.mkdir(parents=True)
    marker = path / MARKER
    marker.write_text(json.dumps({"kind": "lite"}))
    made = subprocess.run(["chattr", "+i", str(marker)], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot make a file immutable here: {made.stderr.strip()}")
    yield path
    subprocess.run(["chattr", "-i", str(marker)], check=False)


def test_rank_0_failing_to_write_the_marker_fails_every_rank_with_the_same_message(
    tmp_path: Path, immutable_marker: Path
) -> None:
    result = trainyard(*train_args(tmp_path, *LORA_DDP, f"train.max_steps={2 * EVERY}"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    message = "".join(result.stderr.split())
    assert f"committingcheckpoint{immutable_marker}failedonrank0" in message, result.stderr[-3000:]
    logs = [(tmp_path / "tiny" / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1)]
    failures = [[line.split(" ERROR ", 1)[1] for line in log.splitlines() if " ERROR " in line] for log in logs]
    assert failures[0] and failures[0] == failures[1], failures
    assert "Operation not permitted" in failures[0][0]
    assert committed(tmp_path / "tiny" / "checkpoints") == []

"""A save that cannot be written stops the run with the dir named, or, with
checkpoint.on_error=continue, is reported and skipped; the previous checkpoint survives."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import assert_ok, events, trainyard
from tests.dist.checkpoint_helpers import EVERY, FULL_FSDP, LORA_DDP, STEPS, train_args
from trainyard.checkpoint import committed, latest_full, step_dir

pytestmark = pytest.mark.dist


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


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
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(target)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


def test_full_disk_stops_naming_the_dir_or_continues_when_asked(tmp_path: Path, tmpfs_checkpoints: Path) -> None:
    checkpoints = tmpfs_checkpoints
    assert_ok(trainyard(*train_args(tmp_path, *LORA_DDP, f"train.max_steps={EVERY}")))
    first = step_dir(checkpoints, EVERY)
    before = digest(first)
    fill(checkpoints)

    stopped = trainyard(*train_args(tmp_path, *LORA_DDP))
    assert stopped.returncode != 0
    message = "".join(stopped.stderr.split())  # the console wraps long lines anywhere
    assert str(step_dir(checkpoints, 2 * EVERY)) in message and "Nospaceleftondevice" in message, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert latest_full(checkpoints) == first and committed(checkpoints) == [first]
    assert digest(first) == before

    continued = trainyard(*train_args(tmp_path, *LORA_DDP, "checkpoint.on_error=continue"))
    assert_ok(continued)
    failed = [e["step"] for e in events(tmp_path / "tiny", "system") if e.get("event") == "checkpoint_failed"]
    assert failed[0] == 2 * EVERY and failed[-1] == STEPS, failed
    assert f'"steps": {STEPS}' in (tmp_path / "tiny" / "summary.json").read_text()
    assert latest_full(checkpoints) == first and digest(first) == before


def test_unwritable_checkpoint_dir_is_reported_and_skipped_with_on_error_continue(tmp_path: Path) -> None:
    """A file where a step folder must go: every rank's mkdir fails (chmod would not stop root)."""
    checkpoints = tmp_path / "tiny" / "checkpoints"
    checkpoints.mkdir(parents=True)
    blocked = step_dir(checkpoints, 2 * EVERY)
    blocked.write_text("not a folder")
    result = trainyard(*train_args(tmp_path, *FULL_FSDP, "checkpoint.on_error=continue", f"train.max_steps={3 * EVERY}"))
    assert_ok(result)
    failures = [e for e in events(tmp_path / "tiny", "system") if e.get("event") == "checkpoint_failed"]
    assert [e["step"] for e in failures] == [2 * EVERY]
    assert str(blocked) in failures[0]["error"]
    assert [p.name for p in committed(checkpoints)] == [step_dir(checkpoints, s).name for s in (EVERY, 3 * EVERY)]
    assert blocked.read_text() == "not a folder"

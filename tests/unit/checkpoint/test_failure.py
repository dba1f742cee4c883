"""A save onto a full disk says where, how much was free and how much it needed, in words: no traceback text."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainyard.checkpoint.failure import save_error, state_bytes
from trainyard.checkpoint.save import _write_shards

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs with every block taken."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    target = tmp_path / "disk"
    target.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)], capture_output=True, text=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    with open(target / "filler", "wb", buffering=0) as handle:
        try:
            while handle.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_dcp_save_onto_a_full_disk_names_the_path_the_free_and_the_needed_bytes(full_disk: Path) -> None:
    state = {"model": {"w": torch.ones(256, 256)}, "optim": {"exp_avg": torch.zeros(256, 256, dtype=torch.bfloat16)}}
    path = full_disk / "step-00000008"
    with pytest.raises(RuntimeError) as raised:
        _write_shards(state, path, async_save=False, process_group=None)
    assert "Traceback" not in str(raised.value), str(raised.value)
    error = save_error(path, raised.value, state_bytes(state))
    assert state_bytes(state) == 256 * 256 * (4 + 2)
    free = shutil.disk_usage(full_disk).free
    assert error.what == (
        f"saving checkpoint {path} failed: No space left on device: {free:,} bytes free on its file system, "
        f"the save needs about {256 * 256 * 6:,} bytes"
    ), error.what
    assert error.exit_code == 2


def test_another_failure_is_named_without_the_space_figures(tmp_path: Path) -> None:
    blocker = tmp_path / "step-00000008"
    blocker.write_text("a file where the folder goes")
    with pytest.raises(RuntimeError) as raised:
        _write_shards({"model": {"w": torch.ones(4)}}, blocker, async_save=False, process_group=None)
    error = save_error(blocker, raised.value, 16)
    assert str(blocker) in error.what and "bytes free" not in error.what and "Traceback" not in error.what, error.what

"""Finding, cleaning and rotating checkpoint folders; what export refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli
from trainyard.checkpoint.export import export, find_checkpoint
from trainyard.checkpoint.save import (
    MARKER,
    check_compatible,
    committed,
    latest_full,
    remove_uncommitted,
    resolve_resume,
    rotate,
    step_dir,
    write_marker,
)
from trainyard.config_file import dump_config, load_config
from trainyard.errors import CheckpointError, OptionError


def make(checkpoints: Path, step: int, kind: str | None = "full") -> Path:
    path = step_dir(checkpoints, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard")
    if kind is not None:
        (path / MARKER).write_text(json.dumps({"kind": kind}))
    return path


def names(paths: list[Path]) -> list[int]:
    return [int(p.name[5:]) for p in paths]


def test_rotation_keeps_the_newest_n_and_the_protected_one(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40, 50):
        make(tmp_path, step)
    make(tmp_path, 45, kind="lite")
    removed = rotate(tmp_path, keep_last=2, protected=step_dir(tmp_path, 10))
    assert names(removed) == [20, 30]
    assert names(committed(tmp_path)) == [10, 40, 50]
    assert names(committed(tmp_path, "lite")) == [45]  # lite ones are not counted or touched
    assert not step_dir(tmp_path, 20).exists()


def test_rotation_with_keep_last_1_never_removes_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        make(tmp_path, step)
    rotate(tmp_path, keep_last=1, protected=None)
    assert names(committed(tmp_path)) == [3]
    rotate(tmp_path, keep_last=1, protected=step_dir(tmp_path, 3))
    assert names(committed(tmp_path)) == [3]


def test_rotation_keeps_keep_last_intact_ones_and_never_removes_a_damaged_one(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        write_marker(tmp_path, make(tmp_path, step, kind=None), "full")  # sealed with each file's size
    (step_dir(tmp_path, 30) / "__0_0.distcp").write_bytes(b"sh")  # truncated after its commit
    removed = rotate(tmp_path, keep_last=2, protected=None)
    assert removed == []  # 10 and 20 are the two intact ones a resume could use
    assert names(committed(tmp_path)) == [10, 20, 30]
    write_marker(tmp_path, make(tmp_path, 40, kind=None), "full")
    assert names(rotate(tmp_path, keep_last=2, protected=None)) == [10]
    assert names(committed(tmp_path)) == [20, 30, 40]  # the damaged 30 stays, for whoever restores it


def test_partial_folders_are_removed_and_never_found(tmp_path: Path) -> None:
    make(tmp_path, 4)
    partial = make(tmp_path, 8, kind=None)
    (tmp_path / "LATEST").write_text(partial.name + "\n")  # even if LATEST named it
    (tmp_path / "notes").mkdir()
    assert latest_full(tmp_path) == step_dir(tmp_path, 4)
    assert remove_uncommitted(tmp_path) == [partial]
    assert not partial.exists() and (tmp_path / "notes").exists() and step_dir(tmp_path, 4).exists()


def test_resume_from_a_partial_path_names_it(tmp_path: Path) -> None:
    partial = make(tmp_path / "run" / "checkpoints", 8, kind=None)
    with pytest.raises(CheckpointError, match=re.escape(str(partial))):
        resolve_resume(str(partial), tmp_path)
    make(tmp_path / "run" / "checkpoints", 4)
    assert resolve_resume(str(tmp_path / "run"), tmp_path / "elsewhere") == step_dir(
        tmp_path / "run" / "checkpoints", 4
    )


def test_compatibility_names_only_what_differs(tmp_path: Path) -> None:
    facts = {"model_signature": "a", "lora": {"r": 16}, "data_fingerprint": "d1", "global_batch_samples": 16}
    check_compatible(facts, dict(facts), tmp_path)
    with pytest.raises(CheckpointError) as err:
        check_compatible(facts, {**facts, "data_fingerprint": "d2"}, tmp_path)
    assert "data_fingerprint: checkpoint has 'd1', this job has 'd2'" in err.value.what
    assert "lora" not in err.value.what and "model_signature" not in err.value.what


def run_dir_with(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(load_config(TINY, list(overrides))))
    return run_dir


def test_find_checkpoint_refuses_what_is_not_a_committed_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "absent"))):
        find_checkpoint(tmp_path / "absent")
    run_dir = run_dir_with(tmp_path)
    make(run_dir / "checkpoints", 3, kind="lite")
    with pytest.raises(CheckpointError, match="no committed full checkpoint"):
        find_checkpoint(run_dir)
    partial = make(run_dir / "checkpoints", 6, kind=None)
    with pytest.raises(CheckpointError, match="no COMMITTED marker"):
        find_checkpoint(partial)
    assert find_checkpoint(step_dir(run_dir / "checkpoints", 3)) == step_dir(run_dir / "checkpoints", 3)
    newest = make(run_dir / "checkpoints", 9)
    assert find_checkpoint(run_dir) == newest


def test_export_never_writes_into_a_non_empty_folder(tmp_path: Path) -> None:
    checkpoint = make(run_dir_with(tmp_path) / "checkpoints", 5)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(OptionError, match="not empty"):
        export(checkpoint, out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    with pytest.raises(OptionError, match="full fine-tuning job"):
        export(checkpoint, tmp_path / "new", merge_lora=True)
    assert not (tmp_path / "new").exists()


def test_export_cli_exits_2_naming_a_bad_checkpoint(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    result = run_cli("export", str(missing), "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert str(missing) in "".join(result.stderr.split()) and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()

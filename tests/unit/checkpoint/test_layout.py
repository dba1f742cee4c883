"""A committed checkpoint damaged afterwards (a full disk, a copy cut short, a lost flush): the marker's record of
each file tells it from an intact one; `auto` passes over it, a named one is refused naming the file, and
`trainyard status` marks it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from trainyard import atomic, plan
from trainyard.checkpoint.export import find_checkpoint
from trainyard.checkpoint.save import MARKER, damage, resolve_resume, set_aside, step_dir, write_marker
from trainyard.errors import CheckpointError
from trainyard.runs.status import format_status, read_status

FILES = {
    "__0_0.distcp": b"\x01" * 4096,
    "__1_0.distcp": b"\x02" * 4096,
    ".metadata": b"\x80\x04metadata" * 20,
    "trainer_state.json": json.dumps({"step": 8, "world_size": 2}).encode(),
    "rank-0.json": json.dumps({"sampler": {"position": 16}}).encode(),
    "rank-1.json": json.dumps({"sampler": {"position": 16}}).encode(),
    "adapter/adapter_model.safetensors": b"\x03" * 2048,
    "adapter/adapter_config.json": b'{"r": 16}',
}


def sealed(checkpoints: Path, step: int, kind: str = "full", files: dict[str, bytes] = FILES) -> Path:
    """A checkpoint folder with the files a 2-rank LoRA save writes, committed as the save commits it."""
    path = step_dir(checkpoints, step)
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    write_marker(checkpoints, path, kind)
    return path


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path: Path) -> None:
    """Same size, other bytes: what a lost flush or a bad copy leaves."""
    data = path.read_bytes()
    path.write_bytes(data[:-4] + bytes(255 - b for b in data[-4:]))


DAMAGE: dict[str, tuple[str, Callable[[Path], None], str]] = {
    # kind: (the file, as DCP, the trainer and PEFT name it; what is done to it; how the message says it)
    "truncated shard": ("__1_0.distcp", truncate, "truncated"),
    "missing shard": ("__0_0.distcp", Path.unlink, "is missing"),
    "truncated .metadata": (".metadata", truncate, "truncated"),
    "garbled trainer_state.json": ("trainer_state.json", garble, "garbled"),
    "garbled rank file": ("rank-1.json", garble, "garbled"),
    "damaged adapter": ("adapter/adapter_model.safetensors", truncate, "truncated"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_is_named_passed_over_by_auto_and_refused_by_name(tmp_path: Path, kind: str) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("{}")
    checkpoints = run_dir / "checkpoints"
    older, newest = sealed(checkpoints, 4), sealed(checkpoints, 8)
    name, hurt, how = DAMAGE[kind]
    hurt(newest / name)
    left = sorted(p.relative_to(newest) for p in newest.rglob("*"))

    problem = damage(newest)
    assert problem is not None and str(newest / name) in problem and how in problem, problem
    assert damage(older) is None
    assert resolve_resume("auto", checkpoints) == older
    assert resolve_resume(str(run_dir), tmp_path / "elsewhere") == older
    assert find_checkpoint(run_dir) == older
    for named in (lambda: resolve_resume(str(newest), checkpoints), lambda: find_checkpoint(newest)):
        with pytest.raises(CheckpointError) as err:
            named()
        assert str(newest / name) in err.value.what and how in err.value.what, err.value.what
    assert plan.reading.auto_resume_words(run_dir) == f"auto: from {older} (passing over damaged {newest.name})"
    status = read_status(run_dir)
    assert list(status["damaged_checkpoints"]) == [newest.name]
    assert f"DAMAGED checkpoint {newest.name}" in format_status(status)
    assert sorted(p.relative_to(newest) for p in newest.rglob("*")) == left, "a damaged checkpoint was touched"


def test_auto_starts_fresh_when_every_committed_checkpoint_is_damaged(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    for step in (4, 8):
        truncate(sealed(checkpoints, step) / "__0_0.distcp")
    assert resolve_resume("auto", checkpoints) is None
    words = plan.reading.auto_resume_words(tmp_path)
    assert "every committed checkpoint" in words and "step-00000004, step-00000008" in words, words
    assert (step_dir(checkpoints, 4) / MARKER).is_file() and (step_dir(checkpoints, 8) / MARKER).is_file()


def test_a_lite_checkpoint_with_a_damaged_adapter_is_refused_naming_the_file(tmp_path: Path) -> None:
    adapter = {name: data for name, data in FILES.items() if name.startswith("adapter/")}
    lite = sealed(tmp_path / "run" / "checkpoints", 6, kind="lite", files=adapter)
    assert find_checkpoint(lite) == lite
    garble(lite / "adapter" / "adapter_config.json")
    with pytest.raises(CheckpointError, match="adapter_config.json is garbled"):
        find_checkpoint(lite)


def test_files_beyond_the_checksum_budget_are_checked_by_size_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards of a real model are GBs: the commit reads only the small files."""
    monkeypatch.setattr(atomic, "CHECKSUM_BUDGET_BYTES", 4096)
    path = sealed(tmp_path, 8)
    files = json.loads((path / MARKER).read_text())["files"]
    assert "crc32" in files["trainer_state.json"] and "crc32" not in files["__0_0.distcp"]
    garble(path / "__0_0.distcp")
    assert damage(path) is None
    truncate(path / "__0_0.distcp")
    assert damage(path) == f"{path / '__0_0.distcp'} is truncated: 2,048 bytes, 4,096 when it was written"


def test_a_marker_from_before_file_records_is_taken_as_intact(tmp_path: Path) -> None:
    path = sealed(tmp_path, 8)
    (path / MARKER).write_text(json.dumps({"kind": "full"}))
    truncate(path / "__0_0.distcp")
    assert damage(path) is None and resolve_resume("auto", tmp_path) == path


def test_a_damaged_step_set_aside_keeps_its_files_under_another_name(tmp_path: Path) -> None:
    path = sealed(tmp_path, 8)
    truncate(path / "__0_0.distcp")
    first = set_aside(path)
    again = set_aside(sealed(tmp_path, 8))
    assert (first.name, again.name) == ("step-00000008.damaged", "step-00000008.damaged-2")
    assert not path.exists() and "truncated" in (damage(first) or "") and damage(again) is None
    assert resolve_resume("auto", tmp_path) is None  # neither is a step folder any more

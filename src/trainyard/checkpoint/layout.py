"""Which checkpoint folders exist and which of them count: read from the disk alone.

`checkpoints/step-00000100/` counts once its `COMMITTED` marker (JSON: its kind, full or
lite, and each file's size and small files' crc32) is there; it is written last, after every rank's files. A
committed checkpoint whose files no longer match its marker (a full disk, a copy cut short, a lost flush) is
damaged: never loaded, never deleted here; `auto` goes back to the newest intact one. `LATEST` names the newest
committed full one. Finding, cleaning, rotating, choosing the one to resume, and checking
that it fits this job live here; writing and loading the tensors live in checkpoint.py.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from trainyard.atomic import fsync_dir, manifest_damage, write_atomically, write_manifest
from trainyard.errors import CheckpointError
from trainyard.runs import layout as run_layout

MARKER = run_layout.COMMITTED
STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"step-{step:08d}"


def write_marker(checkpoints: Path, path: Path, kind: str) -> None:
    """The commit itself (rank 0 only): the marker last, then LATEST for a full checkpoint.
    A lite marker never replaces an existing one (a full checkpoint stays full)."""
    if kind == "lite" and committed_kind(path) is not None:
        return
    fsync_dir(path)
    write_manifest(path, MARKER, {"kind": kind})
    if kind == "full":
        write_atomically(checkpoints / "LATEST", path.name + "\n")


def committed_kind(path: Path) -> str | None:
    try:
        return json.loads((path / MARKER).read_text())["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def committed(checkpoints: Path, kind: str = "full") -> list[Path]:
    """Committed checkpoints of one kind, oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir() if STEP_DIR.match(p.name) and committed_kind(p) == kind]
    return sorted(found, key=lambda p: p.name)


def latest_full(checkpoints: Path) -> Path | None:
    try:
        candidate = checkpoints / (checkpoints / "LATEST").read_text().strip()
    except OSError:
        candidate = None
    if candidate is not None and committed_kind(candidate) == "full":
        return candidate
    found = committed(checkpoints, "full")
    return found[-1] if found else None


def damage(path: Path) -> str | None:
    """What is wrong with a committed checkpoint's files (the first damaged file named), or None when they are as
    committed. Sizes of all, crc32 of the small ones: cheap enough for every resume, export, eval and status."""
    return manifest_damage(path, MARKER)


def check_intact(path: Path) -> None:
    """A checkpoint named by the user must be whole: say which file is not, and how."""
    if problem := damage(path):
        raise CheckpointError(
            f"checkpoint {path} is damaged: {problem}",
            fix="name an intact checkpoint (checkpoint.resume: auto skips damaged ones), or restore the file",
        )


def newest_intact(checkpoints: Path) -> Path | None:
    """The newest committed full checkpoint (LATEST, or one older) whose files are as committed. Each damaged one
    passed over is logged by name and left in place."""
    latest = latest_full(checkpoints)
    if latest is None:
        return None
    for path in reversed([p for p in committed(checkpoints, "full") if p.name <= latest.name]):
        problem = damage(path)
        if problem is None:
            return path
        logging.getLogger("trainyard").warning("skipping damaged checkpoint %s (left in place): %s", path, problem)
    return None


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the step names (step-00000100.damaged, .damaged-2, ...): kept for whoever
    wants its files, never loaded, rotated or cleaned up, and its step free to be saved again."""
    aside = path.with_name(f"{path.name}.damaged")
    count = 1
    while aside.exists():
        count += 1
        aside = path.with_name(f"{path.name}.damaged-{count}")
    path.rename(aside)
    return aside


def remove_uncommitted(checkpoints: Path) -> list[Path]:
    """Partial checkpoints from a run that died mid-save: never loadable, so removed."""
    removed = []
    if checkpoints.is_dir():
        for path in checkpoints.iterdir():
            if STEP_DIR.match(path.name) and committed_kind(path) is None:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def rotate(checkpoints: Path, keep_last: int, protected: Path | None) -> list[Path]:
    """Drop the oldest intact full checkpoints beyond keep_last intact ones; never the newest or `protected`. A
    damaged one neither counts toward keep_last (no run could resume from it) nor is removed (its files are the
    user's to inspect or restore)."""
    intact = [path for path in committed(checkpoints, "full") if damage(path) is None]
    removed = []
    for path in intact[: max(0, len(intact) - keep_last)]:
        if protected is not None and path.resolve() == protected.resolve():
            continue
        (path / MARKER).unlink()  # uncommit first: a half-deleted dir is never loaded
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def resolve_resume(resume: str, checkpoints: Path) -> Path | None:
    """`auto`: the newest intact committed full checkpoint (or None); `never`; or an explicit path, which must be
    intact."""
    if resume == "never":
        return None
    if resume == "auto":
        return newest_intact(checkpoints)
    path = Path(resume)
    if path.is_dir() and STEP_DIR.match(path.name) is None and (path / run_layout.CHECKPOINTS).is_dir():
        path = newest_intact(path / run_layout.CHECKPOINTS) or path  # a run dir: its newest intact checkpoint
    if committed_kind(path) != "full":
        raise CheckpointError(
            f"checkpoint.resume: {path} is not a committed full checkpoint (no {MARKER} marker of kind full)",
            fix="point it at a checkpoints/step-XXXXXXXX folder of a finished save, or use auto",
        )
    check_intact(path)
    return path


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"cannot read {path / 'trainer_state.json'}: {err}", fix="resume from another checkpoint"
        ) from None


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    """Name every fact that differs between the checkpoint and this job.

    The world size may differ: the global batch may not (accumulation is re-derived to keep
    it), and every saved rank must hold the same global data position, the one resumed from. So may
    dist.expert_parallel: DCP reshards the whole expert stacks (parallel/expert_parallel.whole_stacks).
    """
    differences = [
        f"{key}: checkpoint has {saved.get(key)!r}, this job has {current.get(key)!r}"
        for key in ("model_signature", "lora", "data_fingerprint", "global_batch_samples", "diloco_sites")
        if saved.get(key) != current.get(key)
    ]
    differences += _sampler_disagreements(path, int(saved.get("world_size", 1)))
    if differences:
        raise CheckpointError(
            f"checkpoint {path} does not match this job:\n  " + "\n  ".join(differences),
            fix="resume with the job that wrote it, or set checkpoint.resume: never to start fresh",
        )


def _sampler_disagreements(path: Path, saved_world: int) -> list[str]:
    """Each saved rank's data position; they must agree, or resuming would skip or repeat rows.
    (A missing rank file is load_full's to report, on the rank that needs it.)"""
    positions: dict[str, list[int]] = {}
    for rank in range(saved_world):
        try:
            sampler = json.loads((path / f"rank-{rank}.json").read_text())["sampler"]
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError) as err:
            return [f"rank-{rank}.json: unreadable data position ({err})"]
        positions.setdefault(json.dumps(sampler, sort_keys=True), []).append(rank)
    if len(positions) <= 1:
        return []
    return ["sampler: the saved ranks disagree on the data position: " + "; ".join(
        f"ranks {ranks} at {position}" for position, ranks in positions.items()
    )]

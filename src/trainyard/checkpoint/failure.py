"""What a failed save says: the folder, and for a full disk the free space and the bytes the save needs, in words
rather than the traceback text torch's CheckpointException renders for each rank."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from trainyard.errors import CheckpointError

DISK_FIX = "check free space and permissions of the checkpoint dir; the previous checkpoint is intact"
SPACE_FIX = "free space there (or point output_dir at a larger file system); the previous checkpoint is intact"


def save_error(path: Path, err: BaseException, needed: int, noun: str = "checkpoint") -> CheckpointError:
    """A failed write named by its folder; for a full disk the free space and the bytes the save needs, never
    torch's traceback text (DCP's CheckpointException renders one per rank)."""
    if _out_of_space(err):
        free = shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free
        return CheckpointError(
            f"saving {noun} {path} failed: {os.strerror(errno.ENOSPC)}: {free:,} bytes free on its file "
            f"system, the save needs about {needed:,} bytes",
            fix=SPACE_FIX,
        )
    return CheckpointError(f"saving {noun} {path} failed: {plain(err)}", fix=DISK_FIX)


def _causes(err: BaseException) -> list[BaseException]:
    """The error, what it wraps (DCP's failure of each rank; a cause or context), and so on down."""
    found, todo = [], [err]
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.append(current)
        todo += [pair[0] for pair in getattr(current, "failures", {}).values()]
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return found


def _out_of_space(err: BaseException) -> bool:
    """ENOSPC anywhere in the chain; safetensors' (Rust) I/O errors carry it only in their text."""
    return any(
        getattr(e, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(e) for e in _causes(err)
    )


def plain(err: BaseException) -> str:
    """The message without torch's traceback text: each failed rank's error, one line."""
    failures = getattr(err, "failures", None)
    if not failures:
        return str(err)
    return "; ".join(f"rank {rank}: {type(pair[0]).__name__}: {pair[0]}" for rank, pair in sorted(failures.items()))


def state_bytes(tree: Any) -> int:
    """Bytes of every tensor in a (nested) state dict at its whole size: a DTensor counts its global shape, so the
    sum is what every rank together writes."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(state_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(value) for value in tree)
    return 0

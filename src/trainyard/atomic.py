"""Writing files and folders so that readers see the old version or the new one, never half.

One way to do it for every room: write beside the target under a temporary name, then
rename over it (atomic on POSIX within one filesystem). Knows no other room.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path


def temp_sibling(target: Path) -> Path:
    """A hidden name beside `target`, unique to this process and thread."""
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str, *, durable: bool = True) -> None:
    """Temp file, (fsync), rename. `durable=False` skips the fsyncs for files rewritten every
    few seconds, whose loss in a crash does not matter (heartbeats)."""
    tmp = temp_sibling(path)
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also leave litter behind
        raise
    if durable:
        fsync_dir(path.parent)


def publish_folder(built: Path, target: Path) -> bool:
    """Rename the fully built folder `built` to `target`; False (and `built` removed) when
    another process published `target` first. An existing empty `target` is replaced."""
    try:
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        built.rename(target)
    except OSError:
        if not target.exists():
            raise
        shutil.rmtree(built, ignore_errors=True)
        return False
    return True

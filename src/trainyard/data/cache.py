"""Build a cache folder exactly once among all the processes that share its parent folder.

No process group is needed: every process calls `build_once`; the first to create
`<target>.lock` (atomic.py's `exclusive_lock`) builds into a temp folder and renames it to `<target>`
(atomic), the others poll until `<target>` exists. With a cache shared by all nodes one process
builds; with node-local caches one per node does. Either way a reader only ever sees a
complete folder.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.atomic import LockTimeout, exclusive_lock, process_identity, publish_folder
from trainyard.errors import DataError


def _temp_dir(target: Path, holder: dict[str, Any]) -> Path:
    return target.with_name(f"{target.name}.tmp-{holder['host']}-{holder['pid']}")


def _build_atomically(target: Path, build: Callable[[Path], None]) -> bool:
    temp = _temp_dir(target, process_identity())
    shutil.rmtree(temp, ignore_errors=True)
    try:
        build(temp)
        return publish_folder(temp, target)  # False: another process completed it first; use theirs
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def build_once(target: Path, build: Callable[[Path], None], *, timeout_s: float) -> bool:
    """Make `target` exist; True when this process built it, False when it was built by another.

    `build(folder)` must fill a folder that does not exist yet. If it raises, the lock is
    released and the error propagates; a waiting process then takes the lock and tries itself.
    """
    lock = target.with_name(target.name + ".lock")
    try:
        with exclusive_lock(
            lock,
            timeout_s=timeout_s,
            done=target.exists,
            on_stale=lambda holder: shutil.rmtree(_temp_dir(target, holder), ignore_errors=True),
        ) as held:
            return held and not target.exists() and _build_atomically(target, build)
    except LockTimeout as waited:
        raise DataError(
            f"waited {timeout_s:g}s for another process to prepare {target}; its lock {lock} is held by "
            f"{waited.held_by}",
            fix=f"if no job is preparing this data, delete {lock} and start again; "
            "for very large data raise data.prepare_timeout_s",
        ) from None

"""Build a cache folder exactly once among all the processes that share its parent folder.

No process group is needed: every process calls `build_once`; the first to create
`<target>.lock` with O_CREAT|O_EXCL builds into a temp folder and renames it to `<target>`
(atomic), the others poll until `<target>` exists. With a cache shared by all nodes one process
builds; with node-local caches one per node does. Either way a reader only ever sees a
complete folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.atomic import publish_folder
from trainyard.errors import DataError

POLL_S = 0.2


def process_identity() -> dict[str, Any]:
    """Who holds a lock: host and pid, plus the pid namespace so containers on one host differ."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_ns": pid_ns}


def _try_lock(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        json.dump(process_identity(), file)
    return True


def _read_holder(lock: Path) -> dict[str, Any] | None:
    """The lock's holder, or None when the lock is gone or not written yet."""
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_stale(holder: dict[str, Any] | None) -> bool:
    """Only a holder on this host (and pid namespace) can be seen to be dead."""
    if holder is None:
        return False
    me = process_identity()
    same_machine = holder.get("host") == me["host"] and holder.get("pid_ns") == me["pid_ns"]
    return same_machine and isinstance(holder.get("pid"), int) and not _pid_alive(holder["pid"])


def _temp_dir(target: Path, holder: dict[str, Any]) -> Path:
    return target.with_name(f"{target.name}.tmp-{holder['host']}-{holder['pid']}")


def _break_if_stale(lock: Path, target: Path) -> None:
    """Remove a lock whose holder died, and its half-built folder.

    Breakers on one host take turns under a kernel lock (released if they die), and re-read the
    lock inside it, so two of them never remove each other's fresh lock.
    """
    if not _is_stale(_read_holder(lock)):
        return
    with open(lock.with_name(".lock-breaker"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        holder = _read_holder(lock)
        if _is_stale(holder):
            shutil.rmtree(_temp_dir(target, holder), ignore_errors=True)
            lock.unlink(missing_ok=True)


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
    deadline = time.monotonic() + timeout_s
    while not target.exists():
        if _try_lock(lock):
            try:
                return not target.exists() and _build_atomically(target, build)
            finally:
                lock.unlink(missing_ok=True)
        _break_if_stale(lock, target)
        if time.monotonic() > deadline:
            holder = _read_holder(lock) or {}
            raise DataError(
                f"waited {timeout_s:g}s for another process to prepare {target}; its lock "
                f"{lock} is held by host {holder.get('host', '?')} pid {holder.get('pid', '?')}",
                fix=f"if no job is preparing this data, delete {lock} and start again; "
                "for very large data raise data.prepare_timeout_s",
            )
        time.sleep(POLL_S)
    return False

"""Writing files and folders so that readers see the old version or the new one, never half.

One way to do it for every room: write beside the target under a temporary name, then
rename over it (atomic on POSIX within one filesystem). A folder written by many processes is sealed with a
manifest (each file's size, and a checksum of the small ones) that tells, later, a folder still whole from one a
full disk, a copy cut short or a lost flush damaged. And one way for processes that share a
folder (the ranks of a node, or of every node) to take turns at filling it: a lock file that one
of them creates, while the others wait on it with their own timeout, in no collective. Knows no
other room.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

LOCK_POLL_S = 0.2
CHECKSUM_BUDGET_BYTES = 64 << 20
"""A manifest checksums the folder's files smallest first while their total stays within this: the JSON files,
DCP's .metadata and a LoRA adapter, never the bulk of a model's shards (their size alone is checked), so writing
and checking a manifest reads at most this much."""


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


# ---------------------------------------------------------------- a folder sealed by its manifest


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: Path, name: str, facts: dict[str, Any]) -> None:
    """`folder/name`, written last and atomically: `facts` plus each other file's size (and crc32 within the
    checksum budget), by path relative to the folder."""
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != name)
    sizes = {str(p.relative_to(folder)): p.stat().st_size for p in found}
    files: dict[str, dict[str, int]] = {rel: {"size": size} for rel, size in sizes.items()}
    budget = CHECKSUM_BUDGET_BYTES
    for rel, size in sorted(sizes.items(), key=lambda item: item[1]):
        if size > budget:
            break
        files[rel]["crc32"] = _crc32(folder / rel)
        budget -= size
    write_atomically(folder / name, json.dumps({**facts, "files": files}))


def manifest_damage(folder: Path, name: str) -> str | None:
    """What differs between the folder and the manifest `folder/name` sealed it with, naming the file; None when
    nothing does, or when there is no manifest to check against (an unsealed folder, or one sealed before manifests
    listed files)."""
    try:
        files = json.loads((folder / name).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    problems = [problem for rel, sealed in sorted(files.items()) if (problem := _file_damage(folder / rel, sealed))]
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more damaged files)" if len(problems) > 1 else ""
    return problems[0] + more


def _file_damage(path: Path, sealed: dict[str, int]) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as err:
        return f"{path} cannot be read ({err.strerror})"
    if size != sealed["size"]:
        how = "truncated" if size < sealed["size"] else "grown"
        return f"{path} is {how}: {size:,} bytes, {sealed['size']:,} when it was written"
    try:
        garbled = "crc32" in sealed and _crc32(path) != sealed["crc32"]
    except OSError as err:
        return f"{path} cannot be read ({err.strerror})"
    return f"{path} is garbled: its content differs from when it was written (crc32)" if garbled else None


# ---------------------------------------------------------------- one process at a time


class LockTimeout(TimeoutError):
    """Waited longer than the caller allows for a lock another process holds; the caller names its setting."""

    def __init__(self, lock: Path, holder: dict[str, Any]) -> None:
        self.lock = lock
        self.held_by = f"host {holder.get('host', '?')} pid {holder.get('pid', '?')}"
        super().__init__(f"{lock} is held by {self.held_by}")


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


def _break_if_stale(lock: Path, on_stale: Callable[[dict[str, Any]], None] | None) -> None:
    """Remove a lock whose holder died, after `on_stale(holder)` cleans up what it left half done.

    Breakers on one host take turns under a kernel lock (released if they die), and re-read the
    lock inside it, so two of them never remove each other's fresh lock.
    """
    if not _is_stale(_read_holder(lock)):
        return
    with open(lock.with_name(".lock-breaker"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        holder = _read_holder(lock)
        if holder is not None and _is_stale(holder):
            if on_stale is not None:
                on_stale(holder)
            lock.unlink(missing_ok=True)


def _never() -> bool:
    return False


def _acquire(
    lock: Path, timeout_s: float | None, done: Callable[[], bool], on_stale: Callable[[dict[str, Any]], None] | None
) -> bool:
    """True once this process created `lock`; False as soon as `done()` says another process did the work."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not done():
        if _try_lock(lock):
            return True
        _break_if_stale(lock, on_stale)
        if deadline is not None and time.monotonic() > deadline:
            raise LockTimeout(lock, _read_holder(lock) or {})
        time.sleep(LOCK_POLL_S)
    return False


@contextlib.contextmanager
def exclusive_lock(
    lock: Path,
    *,
    timeout_s: float | None,
    done: Callable[[], bool] = _never,
    on_stale: Callable[[dict[str, Any]], None] | None = None,
) -> Iterator[bool]:
    """Hold `lock` (created with O_CREAT|O_EXCL: one holder among all processes that share its folder, on any
    host) for the block, which sees True; or see False when `done()` came true while waiting.

    Waiting is polling, with no process group: past `timeout_s` (None: no limit) it raises LockTimeout. A lock
    whose holder died on this host is broken. The lock is released when the block ends, raising or not, so a
    waiting process then takes it and can try itself.
    """
    held = _acquire(lock, timeout_s, done, on_stale)
    try:
        yield held
    finally:
        if held:
            lock.unlink(missing_ok=True)

"""SIGSTOP one rank of a running `trainyard train` and time how long until the job says it lost its peers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO


def stop_a_rank(
    command: list[str], heartbeat: Path, settle_s: float = 0.0, before_stop: Callable[[int], None] | None = None
) -> tuple[int, str, float | None]:
    """Start the job, SIGSTOP the rank whose heartbeat file appears (after `settle_s` more seconds, and after
    `before_stop` has looked at its pid), wait for the report; return (exit code, stderr, seconds from the stop to the
    report, None if it never came)."""
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while not heartbeat.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    stopped_pid = json.loads(heartbeat.read_text())["pid"]
    lines: list[tuple[float, str]] = []  # stderr as the user sees it, with arrival times
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stderr))
    reader.start()
    time.sleep(settle_s)
    if before_stop is not None:
        before_stop(stopped_pid)
    os.kill(stopped_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    while not any("lost its peers" in line for _, line in lines) and time.monotonic() - stopped_at < 120:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):  # already killed by the launcher after its grace
        os.kill(stopped_pid, signal.SIGKILL)  # a stopped process ignores the launcher's SIGTERM
    try:
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    reported = [at for at, line in lines if "lost its peers" in line]
    return proc.returncode, "".join(line for _, line in lines), (reported[0] - stopped_at) if reported else None

"""A rank's process title names its job, rank and world, where `ps`, `top` and py-spy read it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

NAMED = "from trainyard.launch.title import name_worker; print(name_worker('tiny'), flush=True); input()"


def _named_process(env: dict[str, str]) -> tuple[str, bytes, bytes]:
    """A process that names itself as a rank does first: what it printed, its /proc cmdline and environ."""
    child = subprocess.Popen([sys.executable, "-c", NAMED], cwd=REPO, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        printed = child.stdout.readline().strip()
        proc = Path(f"/proc/{child.pid}")
        return printed, (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
    finally:
        child.kill()
        child.wait()


def test_a_rank_is_named_by_job_rank_and_world_and_keeps_its_environment() -> None:
    """A torchrun child's RANK stays readable in /proc/PID/environ: the title does not take its memory."""
    env = {key: value for key, value in os.environ.items() if key != "SPT_NOENV"}
    printed, cmdline, environ = _named_process({**env, "RANK": "3", "WORLD_SIZE": "8"})
    assert printed == "trainyard train tiny rank 3/8"
    assert cmdline.rstrip(b"\0") == b"trainyard train tiny rank 3/8"
    assert b"\0RANK=3\0" in b"\0" + environ


def test_a_process_started_alone_keeps_its_command_line() -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE")}
    printed, cmdline, _ = _named_process(env)
    assert printed == "None" and cmdline.split(b"\0")[:2] == [sys.executable.encode(), b"-c"]

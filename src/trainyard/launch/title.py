"""A worker's process title: which job, rank and world a PID is.

A worker forked from the fork server (`launch.forked`) keeps the server's command line and environment, and a
torchrun child's command line names no rank: `ps`, `top`, `py-spy dump --pid` and /proc/PID/cmdline could not
tell rank 3 from rank 5. The title replaces the command line those read, so a hang's stuck PID is found by
looking, and the heartbeats (runs.status) name the same PID beside host and rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import setproctitle


def worker_title(job: str, env: Mapping[str, str] = os.environ) -> str | None:
    """'trainyard train tiny rank 3/8' for a rank started by torchrun (or a launcher acting as it); None for a
    process started alone, whose own command line already says what it runs."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return f"trainyard train {job} rank {env['RANK']}/{env['WORLD_SIZE']}"


def name_worker(job: str) -> str | None:
    """Set this process's title to its `worker_title`, before it joins the group: a rank waiting at the rendezvous
    is named too. Returns the title set.

    setproctitle takes the environment's memory for a title longer than the command line, which would blank
    /proc/PID/environ, where a torchrun child's RANK is read: SPT_NOENV keeps it (the title fits the command line
    it replaces)."""
    title = worker_title(job)
    if title is None:
        return None
    os.environ.setdefault("SPT_NOENV", "1")  # read by the call, not the import
    setproctitle.setproctitle(title)
    return title

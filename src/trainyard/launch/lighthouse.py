"""The torchft lighthouse of a fault-tolerant DiLoCo job: the sites' managers ask it for a quorum at each outer
sync, and it tells a returning site which live peer to heal from. It holds no training state, but it must outlive
the sites that come and go: `trainyard lighthouse CONFIG` runs it on its own (restarted by whatever keeps
services alive there), `trainyard launch --lighthouse` as a child of that launch. Sites that lose it go on alone
and re-join when it is back (diloco/ft.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainyard.config import JobConfig
from trainyard.errors import ConfigError

HEARTBEAT_TIMEOUT_MS = 5_000
"""How long after its last heartbeat a site counts as gone: the survivors' first sync without it waits this long."""


def port(cfg: JobConfig) -> int:
    """The port the lighthouse listens on: the one every site is told (diloco.lighthouse or TORCHFT_LIGHTHOUSE)."""
    address = cfg.diloco.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    number = address.rstrip("/").rpartition(":")[2]
    if not number.isdigit():
        raise ConfigError(
            f"--lighthouse needs the lighthouse's HOST:PORT, and diloco.lighthouse is {cfg.diloco.lighthouse!r}",
            where=cfg.where("diloco.lighthouse"),
            fix="set diloco.lighthouse: HOST:PORT, the address every site reaches this node at",
        )
    return int(number)


def command(cfg: JobConfig) -> list[str]:
    """torchft's lighthouse binary, listening on every address at the job's lighthouse port; a quorum needs one
    site (min_replicas 1), so the sites present go on without the others."""
    if not cfg.diloco.fault_tolerant:
        raise ConfigError(
            "--lighthouse hosts the quorum of a fault-tolerant DiLoCo job, and diloco.fault_tolerant is off",
            where=cfg.where("diloco.fault_tolerant"),
            fix="set dist.strategy: diloco and diloco.fault_tolerant: true, or drop --lighthouse",
        )
    binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchft_lighthouse"
    )
    if binary is None:
        raise ConfigError("torchft_lighthouse is not installed here", fix="pip install 'trainyard[ft]'")
    return [binary, "--bind", f"[::]:{port(cfg)}", "--min_replicas", "1",
            "--join_timeout_ms", str(round(cfg.diloco.join_timeout_s * 1000)),
            "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]


@contextmanager
def hosted(cfg: JobConfig, host: bool) -> Iterator[None]:
    """The lighthouse as a child process for as long as the block runs, where this launch hosts it."""
    if not host:
        yield
        return
    child = subprocess.Popen(command(cfg), env={"RUST_LOG": "warn", **os.environ})  # not every quorum tick
    try:
        yield
    finally:
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()

"""What `trainyard doctor` was asked to check: its options, and the folders and NIC a job config names."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_OUTPUT_DIR = "runs"


@dataclass
class DoctorOptions:
    config: str | None = None
    dirs: list[str] = field(default_factory=list)
    nic: str | None = None
    master: str | None = None
    node_rank: int = 0
    nnodes: int | None = None
    """None: local checks only; a number: also run the cluster probe."""
    nproc: int | None = None
    timeout_s: float = 300.0


@dataclass
class JobTargets:
    """What the job will touch, from its config or the defaults."""

    output_dir: Path
    cache_dirs: list[Path]
    shared_dirs: list[Path]
    nic: str | None
    network: str

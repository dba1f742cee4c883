"""Under torchrun: `trainyard train` against a hub whose first download on this machine is slow (a cold cache).

The first call to snapshot_download sleeps, then "fetches" the model folder the test made; later calls find it
cached and return at once. Each call appends `slow` or `cached` to the log file.

Usage: slow_hub_train.py MODEL_FOLDER DELAY_S LOG_FILE TRAINYARD_ARGS...
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from trainyard.cli import main
from trainyard.model import source


def slow_first_download(folder: Path, delay_s: float, log: Path) -> Callable[..., str]:
    """snapshot_download's stand-in: slow while nothing is cached, then instant."""
    cached = folder.with_name(folder.name + ".cached")

    def snapshot_download(repo_id: str, **_: object) -> str:
        if cached.exists():
            outcome = "cached"
        else:
            time.sleep(delay_s)
            cached.touch()
            outcome = "slow"
        with open(log, "a") as handle:
            handle.write(outcome + "\n")
        return str(folder)

    return snapshot_download


if __name__ == "__main__":
    folder, delay_s, log, *argv = sys.argv[1:]
    source.snapshot_download = slow_first_download(Path(folder), float(delay_s), Path(log))
    main(argv)

"""Run under torchrun with 2 ranks, after 3 all-reduces, in one of two ways:

behind: rank 1 stays away from the 4th all-reduce (busy elsewhere) while rank 0 times out in it;
mismatch: rank 1 calls a broadcast where rank 0 calls the 4th all-reduce; both time out.
Each rank then writes its flight record into the run dir, as health does on a failure."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainyard import health
from trainyard.config import DistConfig
from trainyard.dist import exit_process, init


def main() -> None:
    run_dir, mode = Path(sys.argv[1]), sys.argv[2]
    # the group forms under a timeout a loaded machine's slower rank meets (its imports can finish seconds after its
    # peer's), then its collectives time out after 4 s
    info = init(DistConfig(timeout_s=120), run_dir=run_dir)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=4))
    tensor = torch.ones(3)
    for _ in range(3):
        dist.all_reduce(tensor)
    if mode == "mismatch":
        try:
            dist.all_reduce(tensor) if info.rank == 0 else dist.broadcast(torch.ones(5), src=1)
        except RuntimeError:
            pass
        health.dump_flight_record(run_dir, info)
    elif info.rank == 0:
        try:
            dist.all_reduce(tensor)  # rank 1 never comes
        except RuntimeError:
            health.dump_flight_record(run_dir, info)
    else:  # the failure reaches this rank later, as a lost peer would
        deadline = time.monotonic() + 60
        while not (run_dir / "flight" / "gloo-rank-0").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        health.dump_flight_record(run_dir, info)
    exit_process(0)


if __name__ == "__main__":
    main()

"""Run on 4 ranks (2 DiLoCo sites of 2; torchrun's or a shared world's): train the tiny job with rounds of 4 steps
and write, per rank, every collective the flight recorder saw while it trained (its record id and its group's ranks)
and where each step started and each outer sync began, as record ids, for the test to place each collective in an
inner step or a sync."""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from trainyard import health
from trainyard.config_file import load_config
from trainyard.diloco import outer as diloco
from trainyard.dist import exit_process
from trainyard.train import recipe


def recorded() -> dict:
    """This rank's flight record so far: collectives only, no stacks."""
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))


def next_record_id() -> int:
    return max((entry["record_id"] for entry in recorded()["entries"]), default=-1) + 1


def main() -> None:
    out_dir, result_dir = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = load_config("tiny", [
        f"output_dir={out_dir}", "dist.strategy=diloco", "diloco.groups=2", "diloco.sync_every=4",
        "train.max_steps=8", "log.every_steps=1", "eval.every_steps=0", "eval.at_end=false",
        "checkpoint.at_end=false", "log.tensorboard=false", "log.progress=false",
    ])
    marks: list[tuple[str, int, int]] = []  # ("step" | "sync", step, the first record id after the mark)
    step = [0]
    record_progress, sync = health.record_progress, diloco.OuterSync.sync

    def marking(info, at, phase):  # type: ignore[no-untyped-def]
        if phase == health.CONTROL:
            step[0] = at
            marks.append(("step", at, next_record_id()))
        record_progress(info, at, phase)

    def marked_sync(self):  # type: ignore[no-untyped-def]
        marks.append(("sync", step[0], next_record_id()))
        return sync(self)

    health.record_progress, diloco.OuterSync.sync = marking, marked_sync
    first = next_record_id()  # a shared world's ranks recorded earlier tasks' collectives too
    try:
        recipe.run(cfg)
    finally:
        health.record_progress, diloco.OuterSync.sync = record_progress, sync
    trace = recorded()
    groups = {name: dist.get_process_group_ranks(group) for group, name in c10d._world.pg_names.items()}
    entries = [{"id": e["record_id"], "op": e["profiling_name"], "ranks": groups[e["process_group"][0]]}
               for e in trace["entries"] if e["record_id"] >= first]
    rank = os.environ["RANK"]
    (result_dir / f"rank-{rank}.json").write_text(json.dumps({"marks": marks, "entries": entries}))
    exit_process(0)


if __name__ == "__main__":
    main()

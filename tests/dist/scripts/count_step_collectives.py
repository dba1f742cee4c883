"""Run under torchrun with 2 ranks: train the tiny job and count, per step, the collectives that
trainyard's own code calls (DDP's comm hook and FSDP2 call theirs from torch's modules). Arguments after the
first four are overrides of the job."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch.distributed as dist

from trainyard import health
from trainyard.train import recipe as trainer
from trainyard.config_file import load_config
from trainyard.dist import exit_process

COLLECTIVES = ["all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "reduce", "barrier", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter", "monitored_barrier"]


def main() -> None:
    out_dir, strategy, result_file, every = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
    cfg = load_config("tiny", [
        f"output_dir={out_dir}", f"dist.strategy={strategy}", "train.max_steps=8", f"log.every_steps={every}",
        "eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false", "log.tensorboard=false",
        "log.progress=false", "dist.desync_check_steps=0", *sys.argv[5:],
    ])
    step = [0]  # the step whose control all-reduce was announced last (0: before the loop)
    calls: dict[int, list[str]] = defaultdict(list)
    record_progress = health.record_progress

    def marking(info, at, phase):  # type: ignore[no-untyped-def]
        if phase == health.CONTROL:
            step[0] = at
        record_progress(info, at, phase)

    health.record_progress = marking
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counting(*args, _name=name, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("trainyard"):
                calls[step[0]].append(f"{caller}.{_name}")
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    trainer.run(cfg)  # tears the process group down at its end
    if os.environ["RANK"] == "0":
        result_file.write_text(json.dumps({str(k): v for k, v in calls.items()}))
    exit_process(0)


if __name__ == "__main__":
    main()

"""Run under torchrun: train the tiny job with the given overrides and count, per step, the gradient
reduce-scatters and all-reduces FSDP2 issues, and the FSDP units that hold trainable parameters."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from trainyard import health
from trainyard.train import recipe as trainer
from trainyard.parallel import parallelize as parallel
from trainyard.config_file import load_config
from trainyard.dist import exit_process

FSDP_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
COUNTED = {"reduce_scatter_single": "reduce_scatter", "all_reduce": "all_reduce"}


def trainable_units(model: torch.nn.Module) -> int:
    """FSDP modules that own a trainable parameter (one not inside a nested FSDP module): each
    reduces its gradients as one unit."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    count = 0
    for unit in units:
        nested = {id(p) for other in units if other is not unit and other in set(unit.modules())
                  for p in other.parameters()}
        count += any(p.requires_grad and id(p) not in nested for p in unit.parameters())
    return count


def main() -> None:
    out_dir, result_file, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    cfg = load_config("tiny", [
        f"output_dir={out_dir}", "eval.every_steps=0", "eval.at_end=false", "checkpoint.at_end=false",
        "log.tensorboard=false", "log.progress=false", *overrides,
    ])
    step = [0]  # the step whose control all-reduce was announced last (0: before the loop)
    calls: dict[int, Counter[str]] = defaultdict(Counter)
    units = [0]
    record_progress, apply = health.record_progress, parallel.apply

    def marking(info, at, phase):  # type: ignore[no-untyped-def]
        if phase == health.CONTROL:
            step[0] = at
        record_progress(info, at, phase)

    def wrapping(*args, **kwargs):  # type: ignore[no-untyped-def]
        model = apply(*args, **kwargs)
        units[0] = trainable_units(model)
        return model

    health.record_progress, parallel.apply = marking, wrapping
    for name, label in COUNTED.items():
        original = getattr(dist, name)

        def counting(*args, _label=label, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            if sys._getframe(1).f_globals.get("__name__") == FSDP_COLLECTIVES:
                calls[step[0]][_label] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    summary = trainer.run(cfg)
    if os.environ["RANK"] == "0":
        per_step = {str(k): dict(v) for k, v in calls.items()}
        result_file.write_text(json.dumps({"units": units[0], "accumulation": summary["accumulation"],
                                           "per_step": per_step}))
    exit_process(0)


if __name__ == "__main__":
    main()

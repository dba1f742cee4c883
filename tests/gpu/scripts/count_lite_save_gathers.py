"""Run under torchrun: train the tiny LoRA job with a lite save every 2 steps, and record every all-gather made
while a save runs, c10d (FSDP2's unshard) and functional (DTensor's full_tensor) alike, with the elements it
gathered. Rank 0 writes them as JSON, {step: [[op, elements], ...]}.

    count_lite_save_gathers.py OUT_DIR RESULT_FILE [key=value ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainyard.checkpoint import save as checkpoint
from trainyard.config_file import load_config
from trainyard.dist import exit_process
from trainyard.train import recipe as trainer

JOB = ["lora.enabled=true", "train.max_steps=6", "checkpoint.lite_every_steps=2", "checkpoint.every_steps=0",
       "checkpoint.every_minutes=0", "checkpoint.at_end=false", "eval.every_steps=0", "eval.at_end=false",
       "log.progress=false", "log.tensorboard=false", "dist.desync_check_steps=0"]


class GatherLog(TorchDispatchMode):
    """Every all-gather dispatched while active: its op and how many elements it gathered."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        namespace, name = func.namespace, func._overloadpacket.__name__
        if namespace in ("c10d", "_c10d_functional") and name.replace("_", "").startswith("allgather"):
            # Functional ops return what they gathered; c10d ops fill their first argument in place.
            gathered = out if namespace == "_c10d_functional" else args[0]
            elements = sum(t.numel() for t in tree_leaves(gathered) if isinstance(t, torch.Tensor))
            self.gathers.append((f"{namespace}.{name}", elements))
        return out


def main() -> None:
    out_dir, result_file, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    cfg = load_config("tiny", [f"output_dir={out_dir}", *JOB, *overrides])
    saves: dict[int, list[tuple[str, int]]] = {}
    save_lite = checkpoint.Checkpointer.save_lite

    def recorded(self, model, step):  # type: ignore[no-untyped-def]
        with GatherLog() as log:
            save_lite(self, model, step)
        saves[step] = log.gathers

    checkpoint.Checkpointer.save_lite = recorded
    trainer.run(cfg)  # tears the process group down at its end
    if os.environ["RANK"] == "0":
        result_file.write_text(json.dumps(saves))
    exit_process(0)


if __name__ == "__main__":
    main()

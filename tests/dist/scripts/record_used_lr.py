"""Train the tiny job in one process and record the learning rate of each optimizer step as the
optimizer itself sees it when it steps (a global step pre-hook, which observes and changes nothing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainyard.train import recipe as trainer
from trainyard.config_file import load_config


def main() -> None:
    out_dir, result_file, overrides = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    used: list[float] = []
    hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: used.append(optimizer.param_groups[0]["lr"]))
    try:  # a shared test process runs other jobs after this one
        trainer.run(load_config("tiny", [f"output_dir={out_dir}", *overrides]))
    finally:
        hook.remove()
    result_file.write_text(json.dumps(used))


if __name__ == "__main__":
    main()
